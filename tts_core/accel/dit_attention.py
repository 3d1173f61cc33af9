"""CosyVoice3's pooled DiT attention in one kernel per block and Euler step (Triton): the rotary on q and k,
the context's keys and values read from the pool where they lie, the new frames' written into it.

The generic path (`tts_core.flow.dit_pool.pooled_sdpa`) rotates the first head's channels of q and k into
a fresh copy of both, gathers every row's context frames out of the pool
into a fresh tensor, concatenates the new frames' keys and values to them, writes those into the pool with a
scattered `index_put_`, then runs SDPA with an additive chunk-causal mask. On the H100 at 16 rows x 104 new
frames x 400 context frames the gathers, concatenations and writes took 76 ms of a 144-ms solve (the
attention itself 11 ms, the rotary's copy 12 ms; bench/bench_dit_solve.py): each copies tens of MB per block
and step.

A small kernel first rotates the first head's channels of q and k in place (in fp32, rounded once, as the
compiled path). Then each program takes one guidance row, one head and a block of queries; it reads the row's context
frames from the pool by index (`ctx`, the first `ctx_len` valid), then the new frames' keys and values
(chunk-causal among themselves: a key is seen by the queries of its chunk and later ones, if it is one of
the row's `lengths` real frames, and every query sees its own key so a padded one is never all-masked),
with an online softmax in fp32, as SDPA. The programs of the first query block also store the new keys and
values at the row's `write` frames (padding frames go to the pool's trash frame). A call never reads a
frame it writes (`DiTContextPool.row`: the context stops before the frames a call overwrites).

CUDA only: without Triton (the CPU build of torch) `available()` says so; the CPU path is the generic one.
"""

from __future__ import annotations

import torch

from tts_core.accel.online_softmax import scale_for

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host: CPU torch comes without Triton
    triton = None

BLOCK_M = 64  # queries a program
BLOCK_N = 64  # keys a loop iteration


def available() -> bool:
    return triton is not None


if triton is not None:
    from tts_core.accel.online_softmax import softmax_step

    @triton.jit
    def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, stride_r, stride_n, stride_part, stride_cr, stride_cn, n_new,
                       ROT: tl.constexpr, BLOCK: tl.constexpr):
        """In place: the first ROT channels of q and k of BLOCK frames of one row, x cos + x[pair swapped] sin
        (sin carries each pair's sign, as `apply_rotary`), in fp32 and rounded once, as the compiled path."""
        r = tl.program_id(0)
        j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        d = tl.arange(0, ROT)
        inside = (j < n_new)[:, None]
        cos = tl.load(cos_ptr + r * stride_cr + j[:, None] * stride_cn + d[None, :], mask=inside, other=0.0)
        sin = tl.load(sin_ptr + r * stride_cr + j[:, None] * stride_cn + d[None, :], mask=inside, other=0.0)
        q_base = qkv_ptr + r * stride_r + j[:, None] * stride_n
        for part in range(2):
            base = q_base + part * stride_part
            x = tl.load(base + d[None, :], mask=inside, other=0.0)
            partner = tl.load(base + (d ^ 1)[None, :], mask=inside, other=0.0)
            turned = x.to(tl.float32) * cos.to(tl.float32) + partner.to(tl.float32) * sin.to(tl.float32)
            tl.store(base + d[None, :], turned.to(x.dtype), mask=inside)

    @triton.jit
    def _pooled_attention_kernel(qkv_ptr, pool_ptr, ctx_ptr, ctx_len_ptr, write_ptr, len_ptr, out_ptr,
                                 stride_r, stride_n, stride_part, stride_pg, stride_pkv, stride_pf, stride_or, stride_on,
                                 rows, n_new, ctx_cap, scale, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                                 CHUNK: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
                                 PRECISION: tl.constexpr):
        block = tl.program_id(0)
        row_head = tl.program_id(1)
        r = row_head // HEADS
        h = row_head % HEADS
        guidance = r // rows
        b = r % rows
        m = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, HEAD_DIM)
        live = m < n_new
        q = tl.load(qkv_ptr + r * stride_r + m[:, None] * stride_n + h * HEAD_DIM + d[None, :], mask=live[:, None],
                    other=0.0)
        # Finite start: a row without context (a first chunk with no shared prompt frames) must not make
        # exp(-inf - -inf); the first real key replaces it (exp(-1e30 - s) is 0).
        best = tl.full([BLOCK_Q], -1e30, tl.float32)
        total = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        k_pool = pool_ptr + guidance * stride_pg + h * HEAD_DIM
        v_pool = k_pool + stride_pkv
        ctx_len = tl.load(ctx_len_ptr + b)
        for start in range(0, ctx_len, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            ok = cols < ctx_len
            frames = tl.load(ctx_ptr + b * ctx_cap + cols, mask=ok, other=0)
            keys = tl.load(k_pool + frames[:, None] * stride_pf + d[None, :], mask=ok[:, None], other=0.0)
            values = tl.load(v_pool + frames[:, None] * stride_pf + d[None, :], mask=ok[:, None], other=0.0)
            best, total, acc = softmax_step(q, keys, values, ok[None, :], best, total, acc, scale, PRECISION)
        length = tl.load(len_ptr + b)
        q_chunk = m // CHUNK
        for start in range(0, n_new, BLOCK_K):
            j = start + tl.arange(0, BLOCK_K)
            inside = j < n_new
            k_base = qkv_ptr + r * stride_r + j[:, None] * stride_n + stride_part + h * HEAD_DIM
            keys = tl.load(k_base + d[None, :], mask=inside[:, None], other=0.0)
            values = tl.load(k_base + stride_part + d[None, :], mask=inside[:, None], other=0.0)
            if block == 0:
                frames = tl.load(write_ptr + b * n_new + j, mask=inside, other=0)
                tl.store(k_pool + frames[:, None] * stride_pf + d[None, :], keys.to(pool_ptr.dtype.element_ty),
                         mask=inside[:, None])
                tl.store(v_pool + frames[:, None] * stride_pf + d[None, :], values.to(pool_ptr.dtype.element_ty),
                         mask=inside[:, None])
            real = (j < length) & inside
            seen = (real[None, :] & ((j // CHUNK)[None, :] <= q_chunk[:, None])) | (j[None, :] == m[:, None])
            best, total, acc = softmax_step(q, keys, values, seen, best, total, acc, scale, PRECISION)
        out = acc / total[:, None]
        tl.store(out_ptr + r * stride_or + m[:, None] * stride_on + h * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def pooled_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pool_kv: torch.Tensor,
                     ctx: torch.Tensor, ctx_len: torch.Tensor, write: torch.Tensor, lengths: torch.Tensor, heads: int,
                     chunk: int) -> torch.Tensor:
    """qkv (2B, N, 3, heads x dim_head): the new frames' q, k, v, not yet rotated (rows [0, B) conditioned,
    [B, 2B) not); cos, sin (2B, N, 1, dim_head) the rotary's tables (sin signed per pair), applied to the first
    dim_head channels of q and k; pool_kv one block's and step's pool (2 guidance rows, 2 k|v, frames,
    heads x dim_head); ctx (B, C) pool frames of each row's context, the first ctx_len (B,) of them real;
    write (B, N) the pool frames the new (rotated) keys and values go to; lengths (B,) each row's real new
    frames. -> (2B, N, heads x dim_head) as `dit_pool.pooled_sdpa`. Rotates q and k in qkv in place."""
    if triton is None:
        raise RuntimeError("pooled_attention needs Triton (a CUDA build of torch)")
    two_b, n, _, inner = qkv.shape
    head_dim = inner // heads
    if cos.size(-1) != head_dim or head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"pooled_attention: the rotary must turn one head ({cos.size(-1)} of {head_dim} channels), "
                         "a power of two >= 16")
    if any(t.stride(-1) != 1 for t in (qkv, cos, sin, pool_kv)):
        raise ValueError("pooled_attention: qkv, the rotary tables and the pool must be dense in their channels")
    out = torch.empty((two_b, n, inner), dtype=qkv.dtype, device=qkv.device)
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"
    # The rotary first, in place (q and k of the first head only: ~1/16 of them): folded into the attention's
    # loads it slowed every program down by more than this launch costs (bench/bench_dit_solve.py).
    _rotary_kernel[(two_b, triton.cdiv(n, BLOCK_N))](
        qkv, cos, sin, qkv.stride(0), qkv.stride(1), qkv.stride(2), cos.stride(0), cos.stride(1), n,
        ROT=head_dim, BLOCK=BLOCK_N)
    _pooled_attention_kernel[(triton.cdiv(n, BLOCK_M), two_b * heads)](
        qkv, pool_kv, ctx, ctx_len, write, lengths, out, qkv.stride(0), qkv.stride(1), qkv.stride(2),
        pool_kv.stride(0), pool_kv.stride(1), pool_kv.stride(2), out.stride(0), out.stride(1),
        two_b // 2, n, ctx.size(1), scale_for(head_dim), HEADS=heads, HEAD_DIM=head_dim, CHUNK=chunk,
        BLOCK_Q=BLOCK_M, BLOCK_K=BLOCK_N, PRECISION=precision)
    return out
