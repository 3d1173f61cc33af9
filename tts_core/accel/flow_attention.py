"""CosyVoice2's pooled flow attention in one kernel per transformer block and Euler step (Triton): the
chunk-causal rule applied from frame positions, the context's keys and values and the new frames' read
where they lie.

The uncut block (`SelfAttention.forward` with the pool's context) gathers the context's block inputs,
concatenates the new frames' to them, projects keys and values of both, then runs SDPA with the call's additive
mask (2B, 1, N, C+N). On the H100 at 32 rows x 112 new frames x 800 context frames (bench/bench_flow_pooled.py
--profile) that attention, cuDNN's flash kernel reading the mask, took 49 ms of a 146-ms solve (88 us a block
and step, ~150 TFLOP/s) and the gather + concatenation 10 ms. Cut around the attention
(`pooled_block.SplitBlock`), the context's keys and values are projected from the gathered inputs alone, the
new frames' q, k, v from theirs, and this kernel reads both where they lie: nothing is concatenated, and no
mask is read. On the H200, same bucket: the kernel 71 us against cuDNN's 81, the solve 139 -> 122 ms. A solve
of one stream keeps the uncut block and cuDNN (bench/results/flow_pooled.json). The generic path,
`pooled_block.pooled_sdpa` (concatenation + SDPA), is what CPUs run and what the tests hold the kernel to.

Each program takes one guidance row, one head and a block of queries. It reads the row's real context keys
(the first `ctx_count` of its C: a bucket pads the rest, which are never loaded), then the new frames' keys,
with an online softmax in fp32, as SDPA. A key is seen by a query when both are real frames and the key's
chunk is not after the query's (nor more than `left_chunks` before it, when that is >= 0); a padding query
sees only its own key, as `tts_core.flow.pooled.attention_mask` says, so no row is all-masked.

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


def launch_config(two_b: int, n: int) -> tuple[int, int, int, int]:
    """(queries a program, keys a loop iteration, warps, pipeline stages) for 2B guidance rows of n new frames.
    Measured on the H200 (bench/bench_flow_attention.py, 8 heads x 64, bf16; device us, kernel against SDPA with
    the mask): 64 queries a program at 16 rows and more (32 x 800 x 112: 69 against 81; 32 x 250 x 160: 59
    against 86; 16 x 400 x 112: 31 against 25); with few rows the programs are too few to hide a loop's loads,
    and one 128-query block of 8 warps does best up to 128 new frames (1 x 800 x 112: 31 against 32)."""
    if two_b >= 16 or n > 128:
        return (64, 32, 4, 3)
    return (128, 32, 8, 3)


def available() -> bool:
    return triton is not None


if triton is not None:
    from tts_core.accel.online_softmax import softmax_step

    @triton.jit
    def _visible(q_pos, k_pos, CHUNK: tl.constexpr, LEFT: tl.constexpr):
        """(queries, keys) bool: the chunk-causal rule on absolute positions (-1: padding)."""
        q_chunk = q_pos // CHUNK
        k_chunk = k_pos // CHUNK
        seen = (q_pos >= 0)[:, None] & (k_pos >= 0)[None, :] & (k_chunk[None, :] <= q_chunk[:, None])
        if LEFT >= 0:
            seen = seen & (k_chunk[None, :] >= q_chunk[:, None] - LEFT)
        return seen

    @triton.jit
    def _pooled_flow_attention_kernel(qkv_ptr, ctx_ptr, key_pos_ptr, new_pos_ptr, ctx_count_ptr, out_ptr,
                                      stride_r, stride_n, stride_part, stride_cr, stride_cn, stride_cpart,
                                      stride_or, stride_on, rows, n_new, ctx_cap, scale, HEADS: tl.constexpr,
                                      HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr, LEFT: tl.constexpr,
                                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
        block = tl.program_id(0)
        row_head = tl.program_id(1)
        r = row_head // HEADS
        h = row_head % HEADS
        b = r % rows  # guidance rows [0, B) conditioned, [B, 2B) not: the same frames
        m = block * BLOCK_Q + tl.arange(0, BLOCK_Q)
        d = tl.arange(0, HEAD_DIM)
        live = m < n_new
        q = tl.load(qkv_ptr + r * stride_r + m[:, None] * stride_n + h * HEAD_DIM + d[None, :], mask=live[:, None],
                    other=0.0)
        q_pos = tl.load(new_pos_ptr + b * n_new + m, mask=live, other=-1).to(tl.int32)
        # Finite start: the first seen key replaces it (exp(-1e30 - s) is 0); every query sees one.
        best = tl.full([BLOCK_Q], -1e30, tl.float32)
        total = tl.zeros([BLOCK_Q], tl.float32)
        acc = tl.zeros([BLOCK_Q, HEAD_DIM], tl.float32)
        key_row = key_pos_ptr + b * (ctx_cap + n_new)
        k_ctx = ctx_ptr + r * stride_cr + h * HEAD_DIM
        count = tl.load(ctx_count_ptr + b).to(tl.int32)
        for start in range(0, count, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            ok = cols < count
            keys = tl.load(k_ctx + cols[:, None] * stride_cn + d[None, :], mask=ok[:, None], other=0.0)
            values = tl.load(k_ctx + stride_cpart + cols[:, None] * stride_cn + d[None, :], mask=ok[:, None],
                             other=0.0)
            if LEFT >= 0:
                seen = _visible(q_pos, tl.load(key_row + cols, mask=ok, other=-1).to(tl.int32), CHUNK, LEFT)
            else:  # every context frame precedes the call's first new frame: seen by every real query
                seen = (q_pos >= 0)[:, None] & ok[None, :]
            best, total, acc = softmax_step(q, keys, values, seen, best, total, acc, scale, PRECISION)
        for start in range(0, n_new, BLOCK_K):
            j = start + tl.arange(0, BLOCK_K)
            inside = j < n_new
            k_pos = tl.load(key_row + ctx_cap + j, mask=inside, other=-1).to(tl.int32)
            k_base = qkv_ptr + r * stride_r + j[:, None] * stride_n + stride_part + h * HEAD_DIM
            keys = tl.load(k_base + d[None, :], mask=inside[:, None], other=0.0)
            values = tl.load(k_base + stride_part + d[None, :], mask=inside[:, None], other=0.0)
            seen = _visible(q_pos, k_pos, CHUNK, LEFT) | ((q_pos < 0)[:, None] & (j[None, :] == m[:, None]))
            best, total, acc = softmax_step(q, keys, values, seen, best, total, acc, scale, PRECISION)
        out = acc / total[:, None]
        tl.store(out_ptr + r * stride_or + m[:, None] * stride_on + h * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def pooled_flow_attention(qkv: torch.Tensor, ctx_kv: torch.Tensor, key_pos: torch.Tensor, new_pos: torch.Tensor,
                          ctx_count: torch.Tensor, heads: int, chunk: int, left_chunks: int,
                          config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """qkv (2B, N, 3, heads x head_dim): the new frames' q, k, v (rows [0, B) conditioned, [B, 2B) not);
    ctx_kv (2B, C, 2, heads x head_dim) the context's keys and values; key_pos (B, C+N) and new_pos (B, N) the
    keys' and queries' absolute frame positions (-1: padding); ctx_count (B,) each row's real context keys,
    its first ones. -> (2B, N, heads x head_dim), as `pooled_block.pooled_sdpa` with the call's mask.
    `config`: (queries a program, keys an iteration, warps, stages), default `launch_config`."""
    if triton is None:
        raise RuntimeError("pooled_flow_attention needs Triton (a CUDA build of torch)")
    two_b, n, _, inner = qkv.shape
    head_dim = inner // heads
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"pooled_flow_attention: a head of {head_dim} channels; needs a power of two >= 16")
    if qkv.stride(-1) != 1 or ctx_kv.stride(-1) != 1:
        raise ValueError("pooled_flow_attention: qkv and ctx_kv must be dense in their channels")
    if not (key_pos.is_contiguous() and new_pos.is_contiguous()):
        raise ValueError("pooled_flow_attention: key_pos and new_pos must be contiguous")
    out = torch.empty((two_b, n, inner), dtype=qkv.dtype, device=qkv.device)
    precision = "ieee" if qkv.dtype == torch.float32 else "tf32"
    block_q, block_k, warps, stages = launch_config(two_b, n) if config is None else config
    _pooled_flow_attention_kernel[(triton.cdiv(n, block_q), two_b * heads)](
        qkv, ctx_kv, key_pos, new_pos, ctx_count, out, qkv.stride(0), qkv.stride(1), qkv.stride(2),
        ctx_kv.stride(0), ctx_kv.stride(1), ctx_kv.stride(2), out.stride(0), out.stride(1),
        two_b // 2, n, ctx_kv.size(1), scale_for(head_dim), HEADS=heads, HEAD_DIM=head_dim,
        CHUNK=chunk, LEFT=left_chunks, BLOCK_Q=block_q, BLOCK_K=block_k, PRECISION=precision, num_warps=warps,
        num_stages=stages)
    return out
