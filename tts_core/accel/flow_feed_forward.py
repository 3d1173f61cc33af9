"""The flow estimator's feed-forward half, whole, in one Triton kernel: for y = x + attended (the
block's input plus its attention output), y + W2 gelu(W1 LayerNorm(y) + b1) + b2.

Compiled (compile_flow), a transformer block's feed-forward half is four kernels: the residual add
fused with the LayerNorm, the first product, GELU, the second product (its bias and the residual
enter as the addend: estimator.FeedForward). Each Euler step runs 56 of them, and under
load a first chunk's render is bound by how many small kernels the GPU runs beside each other, not
by arithmetic. Here each program takes `BLOCK_M` rows: it normalises them in registers, then walks
the 1024 hidden units in slices, multiplying into the slice, applying GELU and multiplying out into
a (BLOCK_M, 256) accumulator, so the hidden activations never leave the SM.

Same function as the modules (exact GELU, fp32 statistics and accumulation); the captured flow
solves use it when the scheduler's `fused_feed_forward` is on (`use_fused_feed_forward`). Without
Triton (the CPU build of torch) `available()` says so and nothing here can run.
"""

from __future__ import annotations

import torch
from torch import nn

from tts_core.flow.estimator import FeedForward, FlowEstimator, TransformerBlock

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host: CPU torch comes without Triton
    triton = None

BLOCK_H = 64  # hidden units per slice


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _feed_forward_kernel(x_ptr, attended_ptr, out_ptr, norm_w_ptr, norm_b_ptr, w1_ptr, b1_ptr, w2_ptr, b2_ptr, rows, eps,
                             DIM: tl.constexpr, HIDDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK: tl.constexpr, PRECISION: tl.constexpr):
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        live = m < rows
        d = tl.arange(0, DIM)
        at = m[:, None] * DIM + d[None, :]
        x = tl.load(x_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
        x += tl.load(attended_ptr + at, mask=live[:, None], other=0.0).to(tl.float32)
        mean = tl.sum(x, 1) / DIM
        centred = x - mean[:, None]
        rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 1) / DIM + eps)
        normed = centred * rstd[:, None] * tl.load(norm_w_ptr + d).to(tl.float32)[None, :] \
            + tl.load(norm_b_ptr + d).to(tl.float32)[None, :]
        normed = normed.to(w1_ptr.dtype.element_ty)
        acc = x + tl.load(b2_ptr + d).to(tl.float32)[None, :]
        h = tl.arange(0, BLOCK)
        for start in range(0, HIDDEN, BLOCK):
            # W1 rows [start, start + BLOCK) as (BLOCK, DIM); W2 columns of the slice as (DIM, BLOCK).
            w1 = tl.load(w1_ptr + (start + h)[:, None] * DIM + d[None, :])
            hidden = tl.dot(normed, tl.trans(w1), input_precision=PRECISION)
            hidden += tl.load(b1_ptr + start + h).to(tl.float32)[None, :]
            hidden = 0.5 * hidden * (1.0 + tl.erf(hidden * 0.7071067811865476))
            w2 = tl.load(w2_ptr + d[:, None] * HIDDEN + (start + h)[None, :])
            acc += tl.dot(hidden.to(w2.dtype), tl.trans(w2), input_precision=PRECISION)
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=live[:, None])


@torch.library.custom_op("cosyvoice::flow_feed_forward", mutates_args=())
def flow_feed_forward(x: torch.Tensor, attended: torch.Tensor, norm_weight: torch.Tensor, norm_bias: torch.Tensor,
                      w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                      eps: float) -> torch.Tensor:
    """x, attended (..., dim) -> y + w2 @ gelu(w1 @ layer_norm(y) + b1) + b2 for y = x + attended,
    weights as nn.Linear keeps them (w1 (hidden, dim), w2 (dim, hidden)), all contiguous."""
    if triton is None:
        raise RuntimeError("flow_feed_forward needs Triton (a CUDA build of torch)")
    dim, hidden = w1.size(1), w1.size(0)
    flat = x.reshape(-1, dim).contiguous()
    attended = attended.reshape(-1, dim).contiguous()
    out = torch.empty_like(flat)
    rows = flat.size(0)
    block_m = 16 if rows <= 512 else 64  # small calls (a first chunk: 112 rows) want more programs
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 (tests) without TF32
    _feed_forward_kernel[(triton.cdiv(rows, block_m),)](
        flat, attended, out, norm_weight, norm_bias, w1, b1, w2, b2, rows, eps, DIM=dim, HIDDEN=hidden, BLOCK_M=block_m,
        BLOCK=BLOCK_H, PRECISION=precision, num_warps=4 if block_m == 16 else 8)
    return out.view(x.shape)


@flow_feed_forward.register_fake
def _(x, attended, norm_weight, norm_bias, w1, b1, w2, b2, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _block_feed_forward(x: torch.Tensor, attended: torch.Tensor, norm: nn.LayerNorm, ff: FeedForward) -> torch.Tensor:
    first, second = ff.net[0].proj, ff.net[2]
    return flow_feed_forward(x, attended, norm.weight, norm.bias, first.weight, first.bias, second.weight,
                             second.bias, norm.eps)


def use_fused_feed_forward(estimator: FlowEstimator, on: bool = True) -> int:
    """Make every transformer block of `estimator` run its feed-forward half through the kernel (or,
    `on=False`, through its modules again); returns how many blocks it set. The weights must stay
    where they are from here on (the kernel reads them as they are at each call)."""
    if on and triton is None:
        raise RuntimeError("the fused flow feed-forward needs Triton (a CUDA build of torch)")
    blocks = [m for m in estimator.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        block.fused_feed_forward = _block_feed_forward if on else None
    return len(blocks)
