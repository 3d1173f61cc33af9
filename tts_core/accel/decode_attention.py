"""Decode attention read straight from the static KV cache by slot (a Triton kernel).

The generic path of a decode step (`StaticKVCache.read` + SDPA) first gathers every row's cache
row, all `attend_len` columns of it, into a new tensor (two copy kernels per layer, keys and values),
then runs SDPA with a bool mask over those columns. This kernel does the same attention in one
launch per layer: each program takes one row and one key head, finds the row's slot and length,
and reads only the columns that row has written, with its group of query heads (grouped-query
attention: 7 query heads share a key head in the 0.5B LM) as the rows of one small matrix product.

Same function as the generic path (online softmax in fp32); used for one-token decode steps on
CUDA (`GraphedDecoder(slot_attention=True)` sets it on the cache). Without Triton (the CPU build of
torch) `available()` says so and `decode_attention` refuses to run.
"""

from __future__ import annotations

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host: CPU torch comes without Triton
    triton = None

BLOCK_N = 64  # cache columns per loop iteration


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, slots_ptr, positions_ptr, out_ptr,
                                 stride_qb, stride_qh, stride_kb, stride_kh, stride_kt,
                                 stride_vb, stride_vh, stride_vt, stride_ob, stride_oh, scale,
                                 GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        slot = tl.load(slots_ptr + row)
        length = tl.load(positions_ptr + row) + 1  # the step wrote its own key at `position` first
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        live = g < GROUP
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + row * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=live[:, None], other=0.0)
        k_base = k_ptr + slot * stride_kb + kv_head * stride_kh
        v_base = v_ptr + slot * stride_vb + kv_head * stride_vh
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, length, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < length
            k = tl.load(k_base + cols[:, None] * stride_kt + d[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # Column 0 is valid in the first block, so `best` is finite from then on.
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(v_base + cols[:, None] * stride_vt + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def _launch(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
            positions: torch.Tensor) -> torch.Tensor:
    b, heads, _, head_dim = q.shape
    kv_heads = keys.size(1)
    out = torch.empty((b, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    # tl.dot wants at least 16 rows; fp32 (tests) without TF32, so it matches the generic path.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_attention_kernel[(b, kv_heads)](
        q, keys, values, slots, positions, out,
        q.stride(0), q.stride(1), keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2), out.stride(0), out.stride(1),
        1.0 / math.sqrt(head_dim), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK=BLOCK_N, PRECISION=precision)
    return out


@torch.library.custom_op("cosyvoice::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """q (B, heads, 1, head_dim) at `positions` (B,) of cache rows `slots` (B,); keys/values one
    layer's cache (max_batch, kv_heads, max_len, head_dim), this step's keys already written ->
    (B, heads, 1, head_dim): each row attends to its own columns 0..position."""
    if triton is None:
        raise RuntimeError("decode_attention needs Triton (a CUDA build of torch)")
    return _launch(q, keys, values, slots.contiguous(), positions.contiguous())


@decode_attention.register_fake
def _(q, keys, values, slots, positions):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
