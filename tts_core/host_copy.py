"""Small host values (slots, flags, token ids) onto the GPU without making the host wait.

A plain host-to-device copy in torch (`torch.tensor(..., device="cuda")`, `.to("cuda")`) reads
pageable memory and then synchronizes the current stream: the calling thread waits until all work
already queued on that stream has run. On the decode thread that meant waiting for a running
prefill before the next one could start, and the decode steps (launched from the same thread)
stopped meanwhile. From pinned memory the copy is queued behind that work instead, and torch's
pinned-memory cache keeps the host buffer alive until the copy has run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: torch.Tensor | Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (numbers, equal-length lists of numbers, or a tensor) as a `dtype` tensor on `device`,
    copied without a host wait where it comes from the host to a CUDA device."""
    host = torch.as_tensor(values if isinstance(values, torch.Tensor) else list(values), dtype=dtype)
    if host.device.type == "cpu" and device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)
