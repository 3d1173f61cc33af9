"""CosyVoice3's flow estimator: a diffusion transformer (the official `DiT`, F5-TTS style).

Same call as CosyVoice2's U-Net estimator (x, mask, mu, t, spks, cond -> velocity (B, 80, T)), so the
same `FlowSampler` (Euler steps, cosine schedule, classifier-free guidance) drives it. Inside:

- time: sinusoidal embedding of 1000 t over 256 channels ([sin | cos]), then an MLP to `dim`.
- input: Linear over [x, cond, mu, spks repeated] (channels), plus a causal convolutional position
  embedding (two grouped kernel-31 convs, left padded, Mish) added to it.
- `depth` blocks of adaptive-LayerNorm-zero attention + tanh-GELU feed-forward, conditioned on time.
- rotary position (GPT-J interleaved pairs, base 10000) on the first `dim_head` channels of q and k
  BEFORE the head split: only head 0 carries position, the others are position-free. That is the
  official layout, not a slip; changing it changes every output.

Parameter names follow the official checkpoint (`time_embed.time_mlp.0`, `transformer_blocks.N.
attn_norm.linear`, `ff.ff.0.0`, ...), so `flow.pt` loads strictly, the rotary `inv_freq` included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.flow.chunk_mask import chunk_attention_mask

TIME_EMBED_CHANNELS = 256
TIME_SCALE = 1000.0
ROPE_BASE = 10000.0
POS_CONV_KERNEL = 31
POS_CONV_GROUPS = 16
NORM_EPS = 1e-6


@dataclass(frozen=True)
class DiTConfig:
    dim: int
    depth: int
    heads: int
    dim_head: int
    ff_mult: int
    mel_dim: int
    mu_dim: int
    spk_dim: int
    out_channels: int
    static_chunk_size: int  # mel frames
    num_decoding_left_chunks: int


class TimestepEmbedding(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.time_mlp = nn.Sequential(nn.Linear(TIME_EMBED_CHANNELS, dim), nn.SiLU(), nn.Linear(dim, dim))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = TIME_EMBED_CHANNELS // 2
        freqs = torch.exp(torch.arange(half, device=t.device, dtype=torch.float32) * -(math.log(10000) / (half - 1)))
        angles = TIME_SCALE * t.float()[:, None] * freqs[None]
        emb = torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)
        return self.time_mlp(emb)


class CausalConvPositionEmbedding(nn.Module):
    """Two left-padded grouped convolutions with Mish: each frame sees only itself and the past."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        if dim % POS_CONV_GROUPS:
            raise ValueError(f"DiT dim {dim} must be a multiple of {POS_CONV_GROUPS}")
        self.conv1 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())
        self.conv2 = nn.Sequential(nn.Conv1d(dim, dim, POS_CONV_KERNEL, groups=POS_CONV_GROUPS), nn.Mish())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, dim) -> (B, T, dim)."""
        h = x.transpose(1, 2)
        h = self.conv1(F.pad(h, (POS_CONV_KERNEL - 1, 0)))
        h = self.conv2(F.pad(h, (POS_CONV_KERNEL - 1, 0)))
        return h.transpose(1, 2)


class InputEmbedding(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.mel_dim * 2 + cfg.mu_dim + cfg.spk_dim, cfg.dim)
        self.conv_pos_embed = CausalConvPositionEmbedding(cfg.dim)

    def forward(self, x: torch.Tensor, cond: torch.Tensor, mu: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """(B, T, C) each, spks (B, S) -> (B, T, dim). Channel order is the checkpoint's."""
        spks = spks[:, None, :].expand(-1, x.size(1), -1)
        h = self.proj(torch.cat([x, cond, mu, spks], dim=-1))
        return self.conv_pos_embed(h) + h


class RotaryEmbedding(nn.Module):
    """x-transformers' rotary table; `inv_freq` is a checkpoint buffer (dim_head / 2 values)."""

    def __init__(self, dim_head: int) -> None:
        super().__init__()
        inv_freq = 1.0 / (ROPE_BASE ** (torch.arange(0, dim_head, 2).float() / dim_head))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, frames: int) -> torch.Tensor:
        """(T, dim_head) angles, each frequency repeated for its (even, odd) channel pair."""
        pos = torch.arange(frames, device=self.inv_freq.device, dtype=self.inv_freq.dtype)
        angles = pos[:, None] * self.inv_freq[None]
        return angles.repeat_interleave(2, dim=-1)


def apply_rotary(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate the first angles.size(-1) channels of x (B, T, C) in interleaved pairs; the rest pass."""
    rot = angles.size(-1)
    head, rest = x[..., :rot], x[..., rot:]
    pairs = head.unflatten(-1, (-1, 2))
    rotated_half = torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)
    head = head * angles.cos().to(x.dtype) + rotated_half * angles.sin().to(x.dtype)
    return torch.cat([head, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None, angles: torch.Tensor) -> torch.Tensor:
        q = apply_rotary(self.to_q(x), angles)
        k = apply_rotary(self.to_k(x), angles)
        v = self.to_v(x)
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.to_out[0](out.transpose(1, 2).reshape(b, t, -1))


class AdaLayerNormZero(nn.Module):
    """Six modulations from the time embedding: (shift, scale, gate) for attention, then for the MLP."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 6)

    def forward(self, t_emb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(c[:, None, :] for c in self.linear(F.silu(t_emb)).chunk(6, dim=1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        inner = dim * mult
        # Index 1 is the official (inference-inert) dropout; kept so the keys read ff.0.0 / ff.2.
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner), nn.GELU(approximate="tanh")),
                                nn.Identity(), nn.Linear(inner, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


def _norm(x: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS)


class DiTBlock(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.attn_norm = AdaLayerNormZero(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.dim_head)
        self.ff = FeedForward(cfg.dim, cfg.ff_mult)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor, attn_mask: torch.Tensor | None,
                angles: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(t_emb)
        attn = self.attn(_norm(x) * (1 + scale_msa) + shift_msa, attn_mask, angles)
        if attn_mask is not None:
            # Official: outputs zeroed where the mask's last query row hides a frame (padding only).
            attn = attn * attn_mask[:, 0, -1, :, None].to(attn.dtype)
        x = x + gate_msa * attn
        return x + gate_mlp * self.ff(_norm(x) * (1 + scale_mlp) + shift_mlp)


class AdaLayerNormZeroFinal(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = nn.Linear(dim, dim * 2)

    def forward(self, x: torch.Tensor, t_emb: torch.Tensor) -> torch.Tensor:
        scale, shift = self.linear(F.silu(t_emb)).chunk(2, dim=1)  # scale first: the checkpoint's order
        return _norm(x) * (1 + scale[:, None, :]) + shift[:, None, :]


class DiTEstimator(nn.Module):
    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.time_embed = TimestepEmbedding(cfg.dim)
        self.input_embed = InputEmbedding(cfg)
        self.rotary_embed = RotaryEmbedding(cfg.dim_head)
        self.transformer_blocks = nn.ModuleList([DiTBlock(cfg) for _ in range(cfg.depth)])
        self.norm_out = AdaLayerNormZeroFinal(cfg.dim)
        self.proj_out = nn.Linear(cfg.dim, cfg.out_channels)

    def attention_mask(self, frames: int, streaming: bool, device: torch.device) -> torch.Tensor | None:
        """(frames, frames) bool chunk-causal mask in streaming mode (chunks counted from the prompt's
        first frame), None (all visible) otherwise. Batch 1: no key padding."""
        if not streaming or self.cfg.static_chunk_size <= 0:
            return None
        return chunk_attention_mask(frames, self.cfg.static_chunk_size, self.cfg.num_decoding_left_chunks, device)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, mu: torch.Tensor, t: torch.Tensor, spks: torch.Tensor,
                cond: torch.Tensor, attn_mask: torch.Tensor | None = None, cache: object | None = None) -> torch.Tensor:
        """x, mu, cond (B, 80, T); mask (B, 1, T); t (B,); spks (B, 80); attn_mask (T, T) bool or None
        -> velocity (B, 80, T). `mask` is all ones at batch 1 (the official call never pads)."""
        if cache is not None:
            raise ValueError("the DiT estimator takes no FrameCache: streaming chunks go through DiTContextPool")
        x, mu, cond = (y.transpose(1, 2) for y in (x, mu, cond))
        t_emb = self.time_embed(t.reshape(-1).expand(x.size(0)))
        h = self.input_embed(x, cond, mu, spks)
        angles = self.rotary_embed(h.size(1))
        key_mask = mask.bool()[:, :, None, :]  # (B, 1, 1, T)
        full = key_mask if attn_mask is None else key_mask & attn_mask[None, None]
        full = full.expand(-1, -1, h.size(1), -1)
        for block in self.transformer_blocks:
            h = block(h, t_emb, full, angles)
        return self.proj_out(self.norm_out(h, t_emb)).transpose(1, 2)
