"""Coerce a mono waveform given as numpy or torch, shaped (N,) or (1, N), to a float32 tensor (N,)."""

from __future__ import annotations

import numpy as np
import torch

Waveform = np.ndarray | torch.Tensor


def as_mono_tensor(wav: Waveform, what: str) -> torch.Tensor:
    tensor = torch.from_numpy(np.asarray(wav)) if not isinstance(wav, torch.Tensor) else wav
    if tensor.dim() == 2 and tensor.shape[0] == 1:
        tensor = tensor[0]
    if tensor.dim() != 1:
        raise ValueError(f"{what}: expected a mono waveform (N,) or (1, N), got shape {tuple(tensor.shape)}")
    return tensor.to(torch.float32)
