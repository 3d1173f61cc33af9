"""A decode step's attention in one kernel per layer: rotary, cache write, attention by slot (Triton).

The generic path of a one-token step costs several kernels per layer: the rotary embedding of q and
of k, the two cache writes (`StaticKVCache.write`), then a gather of every row's cache row, all
`attend_len` columns of it, keys and values, and SDPA with a bool mask over those columns. This
kernel does all of it in one launch: each program takes one row and one key head, rotates the row's
queries and key (Qwen2's rotate-half layout, tts_core/llm/rotary.py), writes the key and value at
the row's position of its slot, and attends over only the columns that row has written, with its
group of query heads (grouped-query attention: 7 query heads share a key head in the 0.5B LM) as the
rows of one small matrix product; the new column joins from registers.

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
    def _rotated(base, d, partner, sign, cos, sin, mask, dtype):
        """x * cos + rotate_half(x) * sin of rows at `base` (offsets of each row's head), rounded to
        `dtype` as the generic path's rotated tensors are."""
        x = tl.load(base + d[None, :], mask=mask, other=0.0).to(tl.float32)
        half_turned = tl.load(base + partner[None, :], mask=mask, other=0.0).to(tl.float32) * sign[None, :]
        return (x * cos[None, :] + half_turned * sin[None, :]).to(dtype)

    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, keys_ptr, values_ptr, slots_ptr,
                                 positions_ptr, out_ptr, stride_qb, stride_qh, stride_kb, stride_kh,
                                 stride_vb, stride_vh, stride_cos, stride_sin, stride_cb, stride_ch, stride_ct,
                                 stride_ob, stride_oh, scale, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                                 HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        slot = tl.load(slots_ptr + row)
        position = tl.load(positions_ptr + row)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        live = g < GROUP
        heads = kv_head * GROUP + g
        # rotate_half: the first half of a head takes minus the second half, the second the first.
        partner = (d + HEAD_DIM // 2) % HEAD_DIM
        sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
        cos = tl.load(cos_ptr + row * stride_cos + d).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_sin + d).to(tl.float32)
        cache_type = keys_ptr.dtype.element_ty
        q = _rotated(q_ptr + row * stride_qb + heads[:, None] * stride_qh, d, partner, sign, cos, sin,
                     live[:, None], q_ptr.dtype.element_ty)
        one = tl.arange(0, 1)
        k_new = _rotated(k_ptr + row * stride_kb + kv_head * stride_kh + one[:, None], d, partner, sign,
                         cos, sin, one[:, None] < 1, cache_type)
        v_new = tl.load(v_ptr + row * stride_vb + kv_head * stride_vh + one[:, None] + d[None, :]).to(cache_type)
        k_base = keys_ptr + slot * stride_cb + kv_head * stride_ch
        v_base = values_ptr + slot * stride_cb + kv_head * stride_ch
        tl.store(k_base + position * stride_ct + one[:, None] + d[None, :], k_new)
        tl.store(v_base + position * stride_ct + one[:, None] + d[None, :], v_new)
        # Columns before `position` from the cache, blocks of BLOCK; the new one from registers last
        # (this program just wrote it, and a load here need not see that store).
        best = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        total = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(0, position, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            valid = cols < position
            k = tl.load(k_base + cols[:, None] * stride_ct + d[None, :], mask=valid[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            scores = tl.where(valid[None, :], scores, float("-inf"))
            # Column `start` is valid in every block, so `best` is finite from the first one on.
            new_best = tl.maximum(best, tl.max(scores, 1))
            weights = tl.exp(scores - new_best[:, None])
            rescale = tl.exp(best - new_best)
            total = total * rescale + tl.sum(weights, 1)
            v = tl.load(v_base + cols[:, None] * stride_ct + d[None, :], mask=valid[:, None], other=0.0)
            acc = acc * rescale[:, None] + tl.dot(weights.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        own = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale
        new_best = tl.maximum(best, own)
        weight = tl.exp(own - new_best)
        rescale = tl.exp(best - new_best)
        total = total * rescale + weight
        acc = acc * rescale[:, None] + weight[:, None] * v_new.to(tl.float32)
        out = acc / total[:, None]
        tl.store(out_ptr + row * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    b, heads, _, head_dim = q.shape
    kv_heads = keys.size(1)
    if keys.stride() != values.stride() or keys.stride(-1) != 1:
        raise ValueError("decode_attention: keys and values must share one layout, dense in head_dim")
    q, k, v, cos, sin = (_last_dim_dense(t) for t in (q, k, v, cos, sin))
    out = torch.empty((b, heads, 1, head_dim), dtype=q.dtype, device=q.device)
    group = heads // kv_heads
    # tl.dot wants at least 16 rows; fp32 (tests) without TF32, so it matches the generic path.
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    _decode_attention_kernel[(b, kv_heads)](
        q, k, v, cos, sin, keys, values, slots, positions, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0), sin.stride(0),
        keys.stride(0), keys.stride(1), keys.stride(2), out.stride(0), out.stride(1),
        1.0 / math.sqrt(head_dim), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK=BLOCK_N, PRECISION=precision)
    return out


@torch.library.custom_op("cosyvoice::decode_attention", mutates_args=("keys", "values"))
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor,
                     positions: torch.Tensor) -> torch.Tensor:
    """One-token rows `slots` (B,) at `positions` (B,): q (B, heads, 1, head_dim) and k, v
    (B, kv_heads, 1, head_dim) before the rotary embedding, cos/sin (B, 1, 1, head_dim) its tables
    at the rows' positions; keys/values one layer's cache (max_batch, kv_heads, max_len, head_dim).
    Writes the rotated key and the value at each row's position, then -> (B, heads, 1, head_dim):
    each row attends to its own columns 0..position. Two rows must not share a slot (padding rows
    of a captured step may: they write and read scratch only)."""
    if triton is None:
        raise RuntimeError("decode_attention needs Triton (a CUDA build of torch)")
    return _launch(q, k, v, cos, sin, keys, values, slots.contiguous(), positions.contiguous())


@decode_attention.register_fake
def _(q, k, v, cos, sin, keys, values, slots, positions):
    return torch.empty_like(q, memory_format=torch.contiguous_format)
