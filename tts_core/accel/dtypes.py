"""Inference dtype names as operators write them in config ('bf16', 'fp16', 'fp32')."""

from __future__ import annotations

import torch

_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "half": torch.float16, "fp32": torch.float32, "float32": torch.float32}


def resolve_dtype(name: str | torch.dtype) -> torch.dtype:
    """bf16 is the default for GPU inference: same exponent range as fp32, so the random-init and
    trained activations never overflow, at half the bytes. fp16 is selectable for GPUs without bf16."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _NAMES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of bf16, fp16, fp32") from None
