"""A static, preallocated key/value cache for the speech LM (gpt-fast style).

One buffer pair of shape (layers, max_batch, kv_heads, max_len, head_dim) holds every request's
keys and values; a request owns one batch row ("slot") for its lifetime and `lengths[slot]` counts
the positions written. Shapes never change after allocation, so a decode step over any set of
slots at any mix of positions is a fixed-shape computation a CUDA graph can replay: per-slot
positions live in device tensors, and attention is masked per slot instead of slicing per slot.

This module owns cache memory and slot lengths only; it never decides which slot a request gets
(that is the scheduler's job) and never syncs with the host on the decode path.
"""

from __future__ import annotations

import torch
from torch import nn


class StaticKVCache(nn.Module):
    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (num_layers, max_batch, kv_heads, max_len, head_dim)
        # Non-persistent: cache state must never leak into a model's state dict.
        self.register_buffer("k", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, device=device, dtype=dtype), persistent=False)
        self.register_buffer("lengths", torch.zeros(max_batch, device=device, dtype=torch.long), persistent=False)
        self.register_buffer("columns", torch.arange(max_len, device=device), persistent=False)

    @property
    def max_batch(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def reset(self, slots: torch.Tensor | list[int]) -> None:
        """Forget what `slots` held; stale keys stay but are masked out by the zero length."""
        self.lengths[torch.as_tensor(slots, device=self.lengths.device, dtype=torch.long)] = 0

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v (B, kv_heads, T, head_dim) at `positions` (B, T) of rows `slots` (B,)."""
        rows = slots[:, None]
        # Advanced indices around a slice put the indexed dims first: (B, T, kv_heads, head_dim).
        self.k[layer][rows, :, positions] = k.transpose(1, 2).to(self.k.dtype)
        self.v[layer][rows, :, positions] = v.transpose(1, 2).to(self.v.dtype)

    def read(self, layer: int, slots: torch.Tensor, attend_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, kv_heads, attend_len, head_dim) of rows `slots`."""
        return self.k[layer, slots, :, :attend_len], self.v[layer, slots, :, :attend_len]

    def attention_mask(self, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        """(B, 1, T, attend_len) bool: a query at position p sees cache columns 0..p of its own slot.

        Causality and each slot's length are the same rule here because a step writes its keys
        before attending; columns past a slot's position hold stale data and stay masked."""
        return self.columns[:attend_len][None, None, None, :] <= positions[:, None, :, None]

    def advance(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.lengths[slots] += counts
