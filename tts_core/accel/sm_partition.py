"""CUDA streams confined to a subset of the GPU's SMs (CUDA green contexts), to keep SMs free for
the decode step.

Under load a decode step of the LM took 3.7-4.4 ms where it takes ~1.5 ms alone (H100,
bench/results/load_2026-11-23_h100_stages_gil.json): it is ~200 small kernels in a row, and each
one waits for SMs that the flow's large kernels hold, whatever the stream priorities say (a
priority only orders blocks that have not started). Putting the render work on a green context of
`num_sms` SMs leaves the others to the decode step alone.

A green context only confines its own work: two contexts created with the same count get the same
SMs, and work on ordinary streams may use every SM. So the render lanes go on green streams and
the decode stays on an ordinary one, which then owns the SMs the render lanes cannot reach.
"""

from __future__ import annotations

import torch

_CONTEXTS: list = []  # a green context must outlive every stream made from it


class SmPartitionUnavailable(RuntimeError):
    """This torch build, driver or device cannot confine a stream to a subset of SMs."""


def device_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def green_stream(num_sms: int, device: torch.device) -> torch.cuda.Stream:
    """A new CUDA stream whose kernels (graph replays included) run on `num_sms` SMs of `device`
    (rounded up by the driver to its granularity: 8 on Hopper)."""
    if device.type != "cuda":
        raise SmPartitionUnavailable(f"SM partitioning needs a CUDA device, not {device}")
    total = device_sms(device)
    if not 0 < num_sms < total:
        raise ValueError(f"num_sms must be between 1 and {total - 1} on {torch.cuda.get_device_name(device)}, "
                         f"not {num_sms}")
    try:
        from torch.cuda import green_contexts
    except ImportError as exc:
        raise SmPartitionUnavailable(f"torch {torch.__version__} has no torch.cuda.green_contexts") from exc
    if not getattr(green_contexts, "SUPPORTED", True):
        raise SmPartitionUnavailable(f"torch {torch.__version__} was built without CUDA green contexts")
    try:
        ctx = green_contexts.GreenContext.create(num_sms=num_sms, device_id=device.index or 0)
    except RuntimeError as exc:  # driver too old (green contexts: CUDA 12.4), MIG, ...
        raise SmPartitionUnavailable(f"could not create a green context of {num_sms} SMs: {exc}") from exc
    if not hasattr(ctx, "Stream"):  # torch 2.10: green contexts, but no streams of their own
        raise SmPartitionUnavailable(f"torch {torch.__version__} cannot make a stream of a green context "
                                     "(GreenContext.Stream, torch 2.11+)")
    _CONTEXTS.append(ctx)
    return ctx.Stream()
