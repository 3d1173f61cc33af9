"""Qwen2's rotary position embedding (rotate-half layout): the cos/sin tables and their use.

Its own module because two places apply it: the decoder's generic attention (through the KV cache's
`write_and_attend`) and, inside one kernel, the decode step's slot attention
(tts_core/accel/decode_attention.py), which must match it.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions (Qwen2's rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions (B, T) -> cos, sin (B, 1, T, head_dim), computed in float32."""
        freqs = positions.float()[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., head_dim) rotated by the tables of `RotaryEmbedding` (broadcast over heads)."""
    return x * cos + _rotate_half(x) * sin
