"""A plain Qwen2 decoder whose state-dict keys match the official CosyVoice2 `llm.pt`.

The official `Qwen2LM` holds a `Qwen2Encoder` as `llm`, which holds transformers'
`Qwen2ForCausalLM` as `model`, which holds the decoder stack as `model` and the (unused) text head
as `lm_head`. We keep that nesting (`llm.model.model.layers.N...`, `llm.model.lm_head.weight`) so
official and fine-tuned checkpoints load strictly, and nothing else: the math is Qwen2's (RMSNorm
computed in float32, rotate-half rotary embeddings, grouped-query attention with biased q/k/v, SiLU
gated MLP), sized entirely from the model dir's `config.json`.

Attention reads and writes a `StaticKVCache` (see kv_cache.py); this module never owns cache memory
and never syncs with the host, so one decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tts_core.llm.kv_cache import StaticKVCache
from tts_core.llm.rotary import RotaryEmbedding

Projection = Callable[[torch.Tensor], torch.Tensor]
# (weight (N, K), bias (N,) or None) -> a projection computing x @ weight.T + bias another way (FP8)
ProjectionFactory = Callable[[torch.Tensor, torch.Tensor | None], Projection]


@dataclass(frozen=True)
class Qwen2Config:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    head_dim: int
    tie_word_embeddings: bool

    @classmethod
    def from_json(cls, path: str | Path) -> Qwen2Config:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
        try:
            heads = int(raw["num_attention_heads"])
            hidden = int(raw["hidden_size"])
            if raw.get("hidden_act", "silu") != "silu":
                raise ValueError(f"{path}: hidden_act {raw['hidden_act']!r} is not supported (silu only)")
            if raw.get("rope_scaling"):
                raise ValueError(f"{path}: rope_scaling is not supported")
            return cls(
                hidden_size=hidden,
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
                intermediate_size=int(raw["intermediate_size"]),
                vocab_size=int(raw["vocab_size"]),
                rms_norm_eps=float(raw["rms_norm_eps"]),
                rope_theta=float(raw.get("rope_theta", 10000.0)),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            )
        except KeyError as missing:
            raise ValueError(f"{path}: Qwen2 config lacks {missing}") from None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 like Qwen2 so bf16/fp16 runs keep the reference's precision.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.heads * self.head_dim, cfg.hidden_size, bias=False)
        # Set by fuse/convert: plain attributes, not submodules, so the state dict keeps official keys.
        self._qkv: Projection | None = None
        self._out: Projection | None = None

    def fuse(self) -> None:
        """One q/k/v matmul instead of three (see `fuse_projections`)."""
        if self._qkv is None:
            self._qkv = DenseProjection(_fuse_params(self.q_proj, self.k_proj, self.v_proj, "weight"),
                                        _fuse_params(self.q_proj, self.k_proj, self.v_proj, "bias"))

    def convert(self, make: ProjectionFactory) -> None:
        """q/k/v (fused) and the output projection through `make` (see `convert_projections`)."""
        _convert_once(self._out)
        self.fuse()
        self._qkv = make(*self._qkv.params())
        self._out = make(self.o_proj.weight, None)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: StaticKVCache,
                slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        if self._qkv is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            q, k, v = self._qkv(x).split(
                [self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim], dim=-1)
        q = q.reshape(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        # The explicit mask carries both causality and each slot's own length (kv_cache.attention_mask).
        out = cache.write_and_attend(self.layer_idx, q, k, v, rope, slots, positions, mask,
                                     grouped=self.kv_heads != self.heads)
        out = out.transpose(1, 2).reshape(b, t, self.heads * self.head_dim)
        return self.o_proj(out) if self._out is None else self._out(out)


class DenseProjection:
    """x @ weight.T + bias in one matmul over a (possibly fused) weight the module's parameters view."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight, self.bias = weight, bias

    def params(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.weight, self.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _convert_once(converted: Projection | None) -> None:
    if converted is not None:
        raise RuntimeError("Qwen2 projections were converted already; convert once, after loading")


def _fuse_params(first: nn.Linear, second: nn.Linear, third: nn.Linear | None, name: str) -> torch.Tensor:
    """Concatenate the linears' `name` tensors along the output dim and re-point each linear's own
    parameter at its slice of the result: the state dict keeps official keys and shares memory with
    the fused copy, so loading weights later still updates what the fused matmul reads."""
    linears = [lin for lin in (first, second, third) if lin is not None]
    with torch.no_grad():
        fused = torch.cat([getattr(lin, name).detach() for lin in linears], dim=0)
    start = 0
    for lin in linears:
        old = getattr(lin, name)
        rows = old.shape[0]
        setattr(lin, name, nn.Parameter(fused[start:start + rows], requires_grad=old.requires_grad))
        start += rows
    return fused


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self._gate_up: Projection | None = None  # set by fuse/convert, like Qwen2Attention's
        self._down: Projection | None = None

    def fuse(self) -> None:
        """One gate/up matmul instead of two (see `fuse_projections`)."""
        if self._gate_up is None:
            self._gate_up = DenseProjection(_fuse_params(self.gate_proj, self.up_proj, None, "weight"), None)

    def convert(self, make: ProjectionFactory) -> None:
        """gate/up (fused) and down through `make` (see `convert_projections`)."""
        _convert_once(self._down)
        self.fuse()
        self._gate_up = make(*self._gate_up.params())
        self._down = make(self.down_proj.weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._gate_up is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        else:
            gate, up = self._gate_up(x).chunk(2, dim=-1)
        hidden = F.silu(gate) * up
        return self.down_proj(hidden) if self._down is None else self._down(hidden)


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(cfg, layer_idx)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cache: StaticKVCache,
                slots: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, cache, slots, positions, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen2Model(nn.Module):
    """The decoder stack: embed_tokens, layers, final norm."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(self, embeds: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor, positions: torch.Tensor,
                attend_len: int) -> torch.Tensor:
        """embeds (B, T, D) at absolute `positions` (B, T) of cache rows `slots` (B,) -> hidden (B, T, D).

        Keys/values of these positions are written into the cache first; each query then attends to
        cache positions 0..its own position, read over the first `attend_len` cache columns (a static
        number for captured decode steps)."""
        rope = self.rotary(positions, embeds.dtype)
        mask = cache.attention_mask(positions, attend_len)
        x = embeds
        for layer in self.layers:
            x = layer(x, rope, cache, slots, positions, mask)
        return self.norm(x)

    def fuse_projections(self) -> None:
        """Switch every layer to one q/k/v and one gate/up matmul (fewer, larger GEMMs per step).

        Call after the weights are loaded and moved to their device and dtype: the fused tensors are
        built from the loaded parameters, which then become views of them (no extra memory, same
        state-dict keys). Moving the module afterwards would break that sharing. Idempotent."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    def convert_projections(self, make: ProjectionFactory) -> None:
        """Compute every layer's four projections (q/k/v and gate/up fused, o and down) with
        `make(weight, bias)`, e.g. FP8 matmuls (tts_core.accel.fp8_linear). Embeddings, norms and
        heads are untouched. Like `fuse_projections`: once, after loading and moving; the module's
        parameters and state dict stay as loaded."""
        for layer in self.layers:
            layer.self_attn.convert(make)
            layer.mlp.convert(make)


class Qwen2ForCausalLM(nn.Module):
    """Decoder stack plus the text head. The head is unused for speech tokens but kept so the
    checkpoint's `lm_head.weight` loads strictly; tied to embed_tokens when the config says so."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.model = Qwen2Model(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight


class Qwen2Encoder(nn.Module):
    """The official `Qwen2Encoder` wrapper: only here to give keys their `llm.model.` prefix."""

    def __init__(self, cfg: Qwen2Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = Qwen2ForCausalLM(cfg)

    def forward(self, embeds: torch.Tensor, cache: StaticKVCache, slots: torch.Tensor, positions: torch.Tensor,
                attend_len: int) -> torch.Tensor:
        return self.model.model(embeds, cache, slots, positions, attend_len)
