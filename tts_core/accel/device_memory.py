"""Whether a pool allocated once at start fits the device: refused with the sizes before it is allocated.

The flow context pools (CosyVoice2's `FlowContextPool`, CosyVoice3's `DiTContextPool`) are the runtime's largest
allocations and grow with the slot count and the kept context (tens of GiB on a full-size model). An allocation
past the device's memory fails inside torch with a message that names neither; a worker that fails the same way
at every start would be restarted for ever. This check runs first and says what the pool needs and what is free.
"""

from __future__ import annotations

import torch

# Left free beside a pool when it is allocated: graph capture, compiled kernels' workspaces and activations come
# after it (~10 GiB on the H100 besides weights and pool, docs/PERF_NOTES.md "What a slot costs").
HEADROOM_BYTES = 4 * 2**30


class DeviceMemoryShort(RuntimeError):
    """A pool that cannot fit: `what` needs `need` bytes, the device has `free`."""

    def __init__(self, what: str, need: int, free: int) -> None:
        super().__init__(f"{what} needs {need / 2**30:.1f} GiB but the device has {free / 2**30:.1f} GiB free "
                         f"({HEADROOM_BYTES / 2**30:.0f} GiB must stay free beside it)")
        self.what, self.need, self.free = what, need, free


def check_fits(what: str, need: int, free: int) -> None:
    """Raise DeviceMemoryShort unless `need` bytes leave the headroom free of `free`."""
    if need + HEADROOM_BYTES > free:
        raise DeviceMemoryShort(what, need, free)


def check_device_fits(what: str, need: int, device: torch.device) -> None:
    """`check_fits` against the CUDA device's free memory now; no check elsewhere (host memory is the OS's)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        check_fits(what, need, free)
