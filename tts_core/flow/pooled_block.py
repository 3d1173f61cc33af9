"""A transformer block of a pooled flow call cut around its attention, so that the attention can be one
kernel (tts_core/accel/flow_attention.py) between two compiled regions (accel/flow_pool_graphs).

The same arithmetic as `TransformerBlock.forward` with a `context_pool.AttentionContext`: normalise, project
the new frames' q, k, v and the pooled context's k, v (the block inputs kept in the pool, re-projected), the
attention, then keep the new frames' block inputs in the pool (after the last read of it: a ring slot this
call overwrites is still read with its old content), the output projection, the residual and the feed-forward.

`SplitBlock` is what `estimator.Regions.block` runs (made by accel/flow_pool_graphs.compiled_estimator).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.flow.context_pool import AttentionContext, StepIndex

QKV = ("to_q", "to_k", "to_v")
KV = ("to_k", "to_v")

# attention(qkv (2B, N, 3, inner), ctx_kv (2B, C, 2, inner), attn_mask, index, heads) -> (2B, N, inner)
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepIndex, int], torch.Tensor]


def before_attention(block: nn.Module, h: torch.Tensor,
                     context: AttentionContext) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
    """h (2B, N, D) -> (what the pool keeps of the block input y = norm1(h): `AttentionContext.to_kept`,
    the new frames' qkv (2B, N, 3, inner), the context's keys and values (2B, C, 2, inner))."""
    attn = block.attn1
    y = block.norm1(h)
    b2, n, d = y.shape
    qkv = F.linear(y, attn.stacked_weight(QKV)).view(b2, n, 3, -1)
    ctx = context.context_inputs(y.dtype).view(b2, -1, d)
    kept = context.to_kept(y.reshape(-1, d))
    return kept, qkv, F.linear(ctx, attn.stacked_weight(KV)).view(b2, ctx.size(1), 2, -1)


def after_attention(block: nn.Module, h: torch.Tensor, kept: tuple[torch.Tensor, ...], out: torch.Tensor,
                    context: AttentionContext) -> torch.Tensor:
    """The new frames' block inputs kept, then the rest of the block: -> h (2B, N, D)."""
    context.write(kept)
    x = h + block.attn1.to_out[0](out)
    return block.ff(block.norm3(x), residual=x)


def pooled_sdpa(qkv: torch.Tensor, ctx_kv: torch.Tensor, attn_mask: torch.Tensor, index: StepIndex,
                heads: int) -> torch.Tensor:
    """The attention of a pooled call as the plain block computes it: [context | new] keys and values, SDPA
    with the call's additive mask (2B, 1, N, C+N)."""
    b2, n, _, inner = qkv.shape
    q, k, v = qkv.unbind(2)
    k = torch.cat([ctx_kv[:, :, 0], k], 1)
    v = torch.cat([ctx_kv[:, :, 1], v], 1)
    split = [t.view(b2, t.size(1), heads, -1).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*split, attn_mask=attn_mask)
    return out.transpose(1, 2).reshape(b2, n, inner)


def whole_block(block: nn.Module, h: torch.Tensor, attn_mask: torch.Tensor, context: AttentionContext) -> torch.Tensor:
    """The block uncut (`TransformerBlock.forward` with the pool's context)."""
    return block(h, attn_mask, context)


@dataclass(frozen=True)
class SplitBlock:
    """`Regions.block` for a pooled call: block(block, h, attn_mask, context) -> h.

    One stream's call (a guidance pair of rows) runs `whole` instead: there the context is only a few
    hundred frames and the work is bound by kernel launches, and the uncut block projects [context | new]
    in one product (`SelfAttention.forward`) into cuDNN's attention, which at one row a program-starved
    kernel does not beat (bench/bench_flow_attention.py). Rows are fixed per captured bucket, so each
    bucket's graph holds one of the two."""

    before: Callable[..., tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]]  # before_attention, compiled
    attention: Attention  # pooled_sdpa or the kernel
    after: Callable[..., torch.Tensor]  # after_attention, compiled
    whole: Callable[..., torch.Tensor]  # whole_block, compiled

    def __call__(self, block: nn.Module, h: torch.Tensor, attn_mask: torch.Tensor,
                 context: AttentionContext) -> torch.Tensor:
        if h.size(0) <= 2:
            return self.whole(block, h, attn_mask, context)
        kept, qkv, ctx_kv = self.before(block, h, context)
        out = self.attention(qkv, ctx_kv, attn_mask, context.index, block.attn1.heads)
        return self.after(block, h, kept, out, context)
