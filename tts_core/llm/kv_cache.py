"""A static, preallocated key/value cache for the speech LM (gpt-fast style).

Each layer owns one key and one value tensor of shape (max_batch, kv_heads, max_len, head_dim); a
request owns one batch row ("slot") for its lifetime and `lengths[slot]` counts the positions
written. Shapes never change after allocation, so a decode step over any set of slots at any mix of
positions is a fixed-shape computation a CUDA graph can replay: per-slot positions live in device
tensors, and attention is masked per slot instead of slicing per slot (or, where the accelerated
decoder set `decode_attention`, one kernel rotates, writes and reads each slot's own columns:
`write_and_attend`).

Why one tensor per layer rather than one 5-D buffer: a write is an `index_put_` straight into a
graph input, which torch.compile keeps in place. Writing through `buffer[layer]` (a view of one
shared buffer) made the compiler functionalize the view and copy the whole cache once per layer
(a compiled step measured 12 ms instead of ~3 ms; docs/PERF_NOTES.md).

This module owns cache memory, slot lengths and how a step attends over them; it never decides which slot a request gets
(that is the scheduler's job) and never syncs with the host on the decode path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.llm.rotary import apply_rotary

# (q, k, v before rotary, cos, sin, keys, values, slots, positions) -> attention output of one-token
# rows, this step's keys/values written into keys/values; see StaticKVCache.write_and_attend
DecodeAttention = Callable[..., torch.Tensor]

CacheSnapshot = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], torch.Tensor]

ATTEND_BUCKET = 256  # eager decode steps read a multiple of this many cache columns


class StaticKVCache(nn.Module):
    def __init__(self, num_layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int,
                 device: torch.device | str | None = None, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        shape = (max_batch, kv_heads, max_len, head_dim)
        # Plain lists, not registered buffers: cache state must never leak into a model's state dict,
        # and nothing moves a cache between devices (it is allocated where the model lives).
        self.keys = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.register_buffer("lengths", torch.zeros(max_batch, device=device, dtype=torch.long), persistent=False)
        self.register_buffer("columns", torch.arange(max_len, device=device), persistent=False)
        # What one-token steps write and attend with, when set (the accelerated decoder sets a kernel
        # that also reads each row's own columns by slot: accel/decode_attention.py); None: rotary,
        # `write`, then `attend` (`read` + SDPA).
        self.decode_attention: DecodeAttention | None = None

    @property
    def max_batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def attend_len(self, longest: int) -> int:
        """Cache columns an eager decode step reads when its longest row holds `longest` positions:
        only the columns some row uses, rounded up to a bucket so the step keeps a few fixed shapes
        (cheaper attention early on)."""
        return min(self.max_len, -(-(longest + 1) // ATTEND_BUCKET) * ATTEND_BUCKET)

    def snapshot(self) -> CacheSnapshot:
        """A copy of every key, value and length, for `restore` (tests and benchmarks rewind with it)."""
        return (tuple(t.clone() for t in self.keys), tuple(t.clone() for t in self.values), self.lengths.clone())

    def restore(self, snap: CacheSnapshot) -> None:
        """Copy a `snapshot` back in place (captured graphs keep pointing at the same memory)."""
        keys, values, lengths = snap
        for dst, src in zip(self.keys + self.values, keys + values):
            dst.copy_(src)
        self.lengths.copy_(lengths)

    def reset(self, slots: torch.Tensor | list[int]) -> None:
        """Forget what `slots` held; stale keys stay but are masked out by the zero length."""
        self.lengths[torch.as_tensor(slots, device=self.lengths.device, dtype=torch.long)] = 0

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store k, v (B, kv_heads, T, head_dim) at `positions` (B, T) of rows `slots` (B,)."""
        # aten's index_put_ with a None index (every head) rather than `t[rows, :, positions] = ...`: Python's
        # `:` becomes a slice view, which the compiler writes back with a slice_scatter over the whole
        # tensor. Advanced indices around the None put the indexed dims first: (B, T, kv_heads, head_dim).
        index = [slots[:, None], None, positions]
        torch.ops.aten.index_put_(self.keys[layer], index, k.transpose(1, 2).to(self.keys[layer].dtype))
        torch.ops.aten.index_put_(self.values[layer], index, v.transpose(1, 2).to(self.values[layer].dtype))

    def read(self, layer: int, slots: torch.Tensor, attend_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values (B, kv_heads, attend_len, head_dim) of rows `slots`."""
        return self.keys[layer][slots, :, :attend_len], self.values[layer][slots, :, :attend_len]

    def write_and_attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         rope: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor, positions: torch.Tensor,
                         mask: torch.Tensor, grouped: bool) -> torch.Tensor:
        """One attention of rows `slots` at `positions` (B, T): q (B, heads, T, head_dim) and k, v
        (B, kv_heads, T, head_dim) before the rotary embedding `rope` (cos, sin of `RotaryEmbedding`).
        Rotates q and k, writes k and v, and attends over `mask` -> (B, heads, T, head_dim)."""
        if q.size(2) == 1 and self.decode_attention is not None:
            return self.decode_attention(q, k, v, *rope, self.keys[layer], self.values[layer], slots,
                                         positions[:, 0])
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        self.write(layer, slots, positions, k, v)
        return self.attend(layer, q, slots, mask, grouped)

    def attend(self, layer: int, q: torch.Tensor, slots: torch.Tensor, mask: torch.Tensor,
               grouped: bool) -> torch.Tensor:
        """q (B, heads, T, head_dim) of rows `slots`, whose keys/values this step already wrote,
        over `mask` (`attention_mask`) -> (B, heads, T, head_dim). `grouped`: query heads share key
        heads (grouped-query attention)."""
        keys, values = self.read(layer, slots, mask.shape[-1])
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=grouped)

    def attention_mask(self, positions: torch.Tensor, attend_len: int) -> torch.Tensor:
        """(B, 1, T, attend_len) bool: a query at position p sees cache columns 0..p of its own slot.

        Causality and each slot's length are the same rule here because a step writes its keys
        before attending; columns past a slot's position hold stale data and stay masked."""
        return self.columns[:attend_len][None, None, None, :] <= positions[:, None, :, None]

    def advance(self, slots: torch.Tensor, counts: torch.Tensor) -> None:
        self.lengths[slots] += counts
