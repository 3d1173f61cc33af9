"""A context pool too large for the device is refused with its size and the free memory, before allocation."""

from __future__ import annotations

import pytest
import torch

from tts_core.accel.device_memory import HEADROOM_BYTES, DeviceMemoryShort, check_device_fits, check_fits

GIB = 2**30


def test_a_pool_that_leaves_the_headroom_free_fits_and_one_byte_more_does_not() -> None:
    check_fits("pool", 10 * GIB, 10 * GIB + HEADROOM_BYTES)
    with pytest.raises(DeviceMemoryShort, match=r"pool needs 10\.0 GiB but the device has 14\.0 GiB free") as info:
        check_fits("pool", 10 * GIB + 1, 10 * GIB + HEADROOM_BYTES)
    assert (info.value.need, info.value.what) == (10 * GIB + 1, "pool")


def test_host_memory_is_not_checked() -> None:
    check_device_fits("pool", 2**62, torch.device("cpu"))  # the OS's to refuse, not ours


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_a_cuda_pool_larger_than_the_device_is_refused() -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    with pytest.raises(DeviceMemoryShort):
        check_device_fits("pool", total, torch.device("cuda", 0))
