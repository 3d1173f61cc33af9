"""The flow's velocity estimator: a one-level causal 1-D U-Net with transformer blocks.

Input: the noisy mel `x`, the encoder conditioning `mu`, the speaker vector (broadcast over time)
and the prompt-mel condition `cond`, stacked on channels (4 x 80 = 320); output: d x / d t (80
channels). Convolutions are causal (left padding only) and attention follows `attn_mask`, so with a
chunk-causal mask a frame's output never depends on later chunks.

Parameter names follow the official checkpoint (`down_blocks.0.0.block1.block.0`, `attn1.to_q`,
`ff.net.0.proj`, ...). Dropout (0 at inference) is omitted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.flow.chunk_mask import chunk_attention_mask
from tts_core.flow.config import EstimatorConfig
from tts_core.flow.frame_cache import FrameCache


@dataclass(frozen=True)
class Regions:
    """Stand-ins for the estimator's repeated modules in a pooled call (accel/flow_pool_graphs
    compiles them): each gets only its own layers' share of the pooled cache, so one compiled
    function serves every instance of a shape.

    block(block, h, attn_mask, cache.attention(block.attn1)) -> h, for `block(h, attn_mask, cache)`;
    resnet(resnet, h, time_bias, cache.conv(conv 1), cache.conv(conv 2)) -> h, for
    `resnet(h, None, time_bias, cache)`."""

    block: Callable[..., torch.Tensor]
    resnet: Callable[..., torch.Tensor]


def _masked(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Zero the padding frames (mask (B, 1, T) of 0/1); None: nothing to zero (FlowEstimator.forward)."""
    return x if mask is None else x * mask


class NhwcConv1d(nn.Conv1d):
    """nn.Conv1d that, after `keep_weight_channels_last()` (accel, before compiling), convolves
    through cuDNN's channels-last kernels: its weight kept once as (out, in, 1, k) channels-last,
    the input viewed (B, C, 1, L). cuDNN runs a bf16 1-D convolution as an NHWC kernel either way;
    from a contiguous (B, C, L) input and weight it transforms both on every call and the output
    back, 5 kernels on the H100 where this is 2 once the input arrives channels-last (inductor
    writes it so for the convolution) and 3 when not (bench/results/conv_layout_2026-11-24_h100.json).
    Same function; not for fp32 HiFT, whose cuDNN kernels are slower channels-last there."""

    weight_nhwc: torch.Tensor | None

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.register_buffer("weight_nhwc", None, persistent=False)

    @torch.no_grad()
    def keep_weight_channels_last(self) -> None:
        """Copy the weight as it is now (loaded, on its device and dtype); not saved with the state dict."""
        if self.padding_mode != "zeros":
            raise ValueError("NhwcConv1d: only zero padding")
        self.weight_nhwc = self.weight.detach().unsqueeze(2).contiguous(memory_format=torch.channels_last)

    def _conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_nhwc is None:
            return super()._conv_forward(x, weight, bias)
        return F.conv2d(x.unsqueeze(2), self.weight_nhwc, bias, (1, self.stride[0]), (0, self.padding[0]),
                        (1, self.dilation[0]), self.groups).squeeze(2)


class CausalConv1d(NhwcConv1d):
    def __init__(self, in_channels: int, out_channels: int, kernel_size: int) -> None:
        super().__init__(in_channels, out_channels, kernel_size)

    def forward(self, x: torch.Tensor, cache: FrameCache | None = None) -> torch.Tensor:
        n = self.kernel_size[0] - 1
        return super().forward(F.pad(x, (n, 0)) if cache is None else cache.conv_input(self, x, n))


class CausalBlock(nn.Module):
    """Masked causal conv -> LayerNorm over channels -> Mish, masked again."""

    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        # Indices mirror the official Sequential (conv, transpose, norm, transpose, mish) so that the
        # checkpoint's `block.0.*` / `block.2.*` keys load; 1, 3 and 4 hold no parameters.
        self.block = nn.ModuleList([CausalConv1d(dim, dim_out, 3), nn.Identity(), nn.LayerNorm(dim_out),
                                    nn.Identity(), nn.Mish()])

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, cache: FrameCache | None = None) -> torch.Tensor:
        h = self.block[0](_masked(x, mask), cache)
        h = self.block[2](h.transpose(1, 2)).transpose(1, 2)
        return _masked(self.block[4](h), mask)


class CausalResnetBlock(nn.Module):
    def __init__(self, dim: int, dim_out: int, time_emb_dim: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = CausalBlock(dim, dim_out)
        self.block2 = CausalBlock(dim_out, dim_out)
        self.res_conv = NhwcConv1d(dim, dim_out, 1)
        self.branch_scale = 1.0  # what block2's output is multiplied by (flow/residual_scale.py)

    def time_bias(self, time_emb: torch.Tensor) -> torch.Tensor:
        """(B, time_emb_dim) -> (B, dim_out): what this block adds to every frame at that flow time."""
        return self.mlp(time_emb)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, time_bias: torch.Tensor,
                cache: FrameCache | None = None, second: FrameCache | None = None) -> torch.Tensor:
        """`second`: block2's cache where it is not `cache` (`Regions`: one per convolution)."""
        h = self.block1(x, mask, cache) + time_bias.unsqueeze(-1)
        h = self.block2(h, mask, cache if second is None else second)
        if self.branch_scale != 1.0:
            h = h * self.branch_scale
        return h + self.res_conv(_masked(x, mask))

    def convolutions(self) -> tuple[nn.Module, nn.Module]:
        """The two convolutions with left context, in call order."""
        return self.block1.block[0], self.block2.block[0]


class SelfAttention(nn.Module):
    """Multi-head self-attention. The q/k/v projections run as one matrix product of their stacked
    weights where that costs no extra work (kernel launches dominate the flow's small calls); the
    stacked weights are made on first use, so the weights must not change after loading."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        inner = heads * head_dim
        self.heads = heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])  # [1] was dropout
        self._stacked: dict[tuple[str, ...], tuple[tuple, torch.Tensor]] = {}

    PROJECTIONS = (("to_q", "to_k", "to_v"), ("to_k", "to_v"), ("to_q",))

    def stack_projections(self) -> None:
        """Make every stacked weight now. torch.compile guards on this cache's contents: one filled
        while tracing would fail the guard on the next call and recompile."""
        for names in self.PROJECTIONS:
            self.stacked_weight(names)

    def stacked_weight(self, names: tuple[str, ...]) -> torch.Tensor:
        weights = [getattr(self, name).weight for name in names]
        # Restacked when the module moves (`.to` keeps the parameter objects and swaps their data);
        # dtype/device, unlike data pointers, compare under torch.compile without a graph break.
        key = tuple((w.dtype, w.device) for w in weights)
        known = self._stacked.get(names)
        if known is None or known[0] != key:
            known = self._stacked[names] = (key, torch.cat(weights).detach())
        return known[1]

    def _project(self, x: torch.Tensor, names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        """x (B, T, dim) -> per named projection (B, heads, T, head_dim), one matrix product."""
        weight = self.stacked_weight(names)
        b, t, _ = x.shape
        out = F.linear(x, weight).view(b, t, len(names), self.heads, -1)
        return tuple(part.transpose(1, 2) for part in out.unbind(2))

    def keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> keys, values (B, heads, T, head_dim)."""
        return self._project(x, ("to_k", "to_v"))

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, cache: FrameCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        if cache is None:
            q, k, v = self._project(x, ("to_q", "to_k", "to_v"))
        else:
            queries: list[torch.Tensor] = []

            def project(seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                # seq = [earlier frames | x]: with little context the queries of the earlier frames
                # cost less than a separate product for x's; with much, they would not. Compiled
                # (GPU graphs, bound by kernel launches), only the row count decides, as it is
                # specialized anyway (one row, more rows) where a context test would compile each
                # side again: one stream's guidance pair (b = 2, e.g. a first chunk) saves the
                # kernel, many streams' rows would pay for all their context's queries.
                merged = b == 2 if torch.compiler.is_compiling() else seq.size(1) <= 4 * t
                if not merged:
                    return self.keys_values(seq)
                q_all, k_all, v_all = self._project(seq, ("to_q", "to_k", "to_v"))
                queries.append(q_all[:, :, -t:])
                return k_all, v_all

            k, v = cache.attention_keys_values(self, x, project)
            q = queries[0] if queries else self._project(x, ("to_q",))[0]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class GeluProjection(nn.Module):
    def __init__(self, dim: int, dim_out: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.proj(x))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int = 4) -> None:
        super().__init__()
        self.net = nn.ModuleList([GeluProjection(dim, dim * mult), nn.Identity(), nn.Linear(dim * mult, dim)])

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + the feed-forward of x. The residual and the output bias enter the last matrix
        product as its addend (one addmm): compiled, `residual + bias` fuses into the kernel that
        normalises x, and no add kernel follows the product."""
        hidden = self.net[0](x)
        out = self.net[2]
        addend = (residual + out.bias).reshape(-1, residual.size(-1))
        return torch.addmm(addend, hidden.reshape(-1, hidden.size(-1)), out.weight.t()).view(residual.shape)


class TransformerBlock(nn.Module):
    """Pre-norm self-attention + GELU feed-forward (no cross-attention)."""

    def __init__(self, dim: int, heads: int, head_dim: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = SelfAttention(dim, heads, head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, cache: FrameCache | None = None) -> torch.Tensor:
        x = x + self.attn1(self.norm1(x), attn_mask, cache)
        return self.ff(self.norm3(x), residual=x)


class TimestepMLP(nn.Module):
    def __init__(self, in_channels: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


def sinusoidal_time(t: torch.Tensor, dim: int, scale: float = 1000.0) -> torch.Tensor:
    """(B,) flow time in [0, 1] -> (B, dim) [sin | cos] features at geometric frequencies."""
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=t.device).float() * -(math.log(10000) / (half - 1)))
    arg = scale * t.unsqueeze(1) * freq.unsqueeze(0)
    return torch.cat((arg.sin(), arg.cos()), dim=-1).to(t.dtype)


def _level(resnet: nn.Module, blocks: nn.ModuleList, tail: nn.Module | None = None) -> nn.ModuleList:
    return nn.ModuleList([resnet, blocks] + ([tail] if tail is not None else []))


class FlowEstimator(nn.Module):
    def __init__(self, cfg: EstimatorConfig) -> None:
        super().__init__()
        self.cfg = cfg
        c, time_dim = cfg.channels, cfg.channels * 4

        def blocks() -> nn.ModuleList:
            return nn.ModuleList(TransformerBlock(c, cfg.num_heads, cfg.attention_head_dim)
                                 for _ in range(cfg.n_blocks))

        self.time_mlp = TimestepMLP(cfg.in_channels, time_dim)
        self.down_blocks = nn.ModuleList([_level(CausalResnetBlock(cfg.in_channels, c, time_dim), blocks(),
                                                 CausalConv1d(c, c, 3))])
        self.mid_blocks = nn.ModuleList(_level(CausalResnetBlock(c, c, time_dim), blocks())
                                        for _ in range(cfg.num_mid_blocks))
        self.up_blocks = nn.ModuleList([_level(CausalResnetBlock(2 * c, c, time_dim), blocks(),
                                               CausalConv1d(c, c, 3))])
        self.final_block = CausalBlock(c, c)
        self.final_proj = NhwcConv1d(c, cfg.out_channels, 1)
        self.residual_scale = 1.0  # the residual stream is carried divided by this (flow/residual_scale.py)

    def attention_mask(self, frames: int, streaming: bool, device: torch.device, start: int = 0) -> torch.Tensor | None:
        """The bool mask every transformer block uses for query frames [start, frames) against key
        frames [0, frames); None means all visible. Batch 1 only, like the official inference: no
        key padding is ever masked."""
        if not streaming or self.cfg.static_chunk_size <= 0:
            return None
        full = chunk_attention_mask(frames, self.cfg.static_chunk_size, self.cfg.num_decoding_left_chunks, device)
        return full[start:]

    @staticmethod
    def _level(x: torch.Tensor, resnet: CausalResnetBlock, blocks: nn.ModuleList, mask: torch.Tensor | None,
               time_bias: torch.Tensor, attn_mask: torch.Tensor | None, cache: FrameCache | None,
               regions: Regions | None) -> torch.Tensor:
        """A resnet, then its transformer blocks (over frames)."""
        if regions is None:
            h = resnet(x, mask, time_bias, cache).transpose(1, 2)
            for block in blocks:
                h = block(h, attn_mask, cache)
        else:  # a pooled call's cache (mask None): each module gets its own share of it
            h = regions.resnet(resnet, x, time_bias, *(cache.conv(c) for c in resnet.convolutions())).transpose(1, 2)
            for block in blocks:
                h = regions.block(block, h, attn_mask, cache.attention(block.attn1))
        return h.transpose(1, 2)

    def resnets(self) -> list[CausalResnetBlock]:
        """The time-conditioned blocks in call order (down, mid..., up)."""
        return [level[0] for level in (*self.down_blocks, *self.mid_blocks, *self.up_blocks)]

    def time_biases(self, t: torch.Tensor) -> list[torch.Tensor]:
        """t (B,) -> per resnet in call order, (B, channels) it adds at that time. Depends on t and
        the weights only, so a caller whose steps use fixed times can compute it once per step
        (tts_core.flow.pooled) instead of ~40 small kernels per step."""
        temb = self.time_mlp(sinusoidal_time(t, self.cfg.in_channels))
        return [resnet.time_bias(temb) for resnet in self.resnets()]

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, mu: torch.Tensor, t: torch.Tensor | None,
                spks: torch.Tensor, cond: torch.Tensor, attn_mask: torch.Tensor | None, cache: FrameCache | None = None,
                time_biases: Sequence[torch.Tensor] | None = None, regions: Regions | None = None) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80); attn_mask (T, T_keys) bool or
        None. With a cache the T frames continue the `cache.start` frames of earlier passes.
        `time_biases`: `time_biases(t)` made beforehand (rows broadcast); t is then unused.

        mask None: no frame is zeroed. Frames past a row's end then carry values, but a valid
        frame never sees them (causal convolutions; `attn_mask` hides them as keys), so a caller
        that discards them (tts_core.flow.pooled) gets the same output for ~80 fewer kernels a step.

        `regions`: what runs the resnets and transformer blocks of a pooled call (its compiled
        modules); needs mask None and a `PooledStepContext` cache."""
        biases = iter(self.time_biases(t) if time_biases is None else time_biases)
        h = torch.cat([x, mu, spks.unsqueeze(-1).expand(-1, -1, x.size(-1)), cond], dim=1)
        if self.residual_scale != 1.0:
            h = h * (1.0 / self.residual_scale)

        resnet, blocks, conv = self.down_blocks[0]
        h = self._level(h, resnet, blocks, mask, next(biases), attn_mask, cache, regions)
        skip = h
        h = conv(_masked(h, mask), cache)
        for resnet, blocks in self.mid_blocks:
            h = self._level(h, resnet, blocks, mask, next(biases), attn_mask, cache, regions)
        resnet, blocks, conv = self.up_blocks[0]
        h = self._level(torch.cat([h, skip], dim=1), resnet, blocks, mask, next(biases), attn_mask, cache, regions)
        h = conv(_masked(h, mask), cache)
        h = self.final_block(h, mask, cache)
        return _masked(self.final_proj(_masked(h, mask)), mask)
