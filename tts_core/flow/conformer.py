"""The conformer pieces of the flow's token encoder (the ESPnet/WeNet variant CosyVoice2 uses).

Pre-norm blocks of relative-position self-attention (Transformer-XL style, arXiv:1901.02860 §3.3,
with ESPnet's symmetric positional table) and a SiLU feed-forward; no convolution module and no
macaron feed-forward. Parameter names follow the official checkpoint (`self_attn.linear_q`,
`pos_bias_u`, `feed_forward.w_1`, `norm_mha`, ...). Dropout is omitted: this is inference only.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.flow.frame_cache import FrameCache


def relative_position_table(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """(1, 2*length-1, d_model) sinusoids for relative positions length-1 ... 0 ... -(length-1).

    Each row depends only on its own position, so building just the rows needed gives the same
    values as the official 5000-row table.
    """
    position = torch.arange(0, length, dtype=torch.float32).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
    positive = torch.zeros(length, d_model)
    negative = torch.zeros(length, d_model)
    positive[:, 0::2] = torch.sin(position * div_term)
    positive[:, 1::2] = torch.cos(position * div_term)
    negative[:, 0::2] = torch.sin(-1 * position * div_term)
    negative[:, 1::2] = torch.cos(-1 * position * div_term)
    table = torch.cat([torch.flip(positive, [0]), negative[1:]], dim=0)
    return table.unsqueeze(0).to(device=device, dtype=dtype)


class LinearInput(nn.Module):
    """Linear + LayerNorm input layer, then the sqrt(d) scale of the relative positional encoding."""

    def __init__(self, idim: int, odim: int) -> None:
        super().__init__()
        self.out = nn.Sequential(nn.Linear(idim, odim), nn.LayerNorm(odim, eps=1e-5))
        self.xscale = math.sqrt(odim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(x) * self.xscale


class RelPositionSelfAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int) -> None:
        super().__init__()
        if n_feat % n_head:
            raise ValueError(f"attention width {n_feat} is not a multiple of {n_head} heads")
        self.h = n_head
        self.d_k = n_feat // n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        self.pos_bias_u = nn.Parameter(torch.zeros(n_head, self.d_k))
        self.pos_bias_v = nn.Parameter(torch.zeros(n_head, self.d_k))

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.size(0), -1, self.h, self.d_k)

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._heads(self.linear_k(x)).transpose(1, 2), self._heads(self.linear_v(x)).transpose(1, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, pos_table: torch.Tensor,
                cache: FrameCache | None = None) -> torch.Tensor:
        """x (B, Tq, D) holds the last Tq of Tk positions (Tk > Tq only with a cache holding the
        earlier keys); mask (Tq, Tk) bool or None (all visible); pos_table (1, 2Tk-1, D)."""
        q = self._heads(self.linear_q(x))  # (B, Tq, H, dk)
        k, v = self._keys_values(x) if cache is None else cache.attention_keys_values(self, x, self._keys_values)
        p = self._heads(self.linear_pos(pos_table)).transpose(1, 2)  # (1, H, 2Tk-1, dk)
        content = torch.matmul((q + self.pos_bias_u).transpose(1, 2), k.transpose(-2, -1))
        position = torch.matmul((q + self.pos_bias_v).transpose(1, 2), p.transpose(-2, -1))
        scores = (content + _relative_shift(position, k.size(2))) / math.sqrt(self.d_k)
        if mask is not None:
            hidden = ~mask
            scores = scores.masked_fill(hidden, float("-inf"))
            attn = torch.softmax(scores, dim=-1).masked_fill(hidden, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        out = torch.matmul(attn, v).transpose(1, 2).reshape(x.size(0), -1, self.h * self.d_k)
        return self.linear_out(out)


def _relative_shift(scores: torch.Tensor, keys: int) -> torch.Tensor:
    """(B, H, Tq, 2Tk-1) scores against the relative table -> (B, H, Tq, Tk). Query row r is
    position i = Tk - Tq + r; entry (r, j) is taken at relative position i - j, table column
    Tk-1-(i-j)."""
    queries = scores.size(2)
    row = torch.arange(keys - queries, keys, device=scores.device).unsqueeze(1)
    col = torch.arange(keys, device=scores.device).unsqueeze(0)
    index = (keys - 1 - row + col).expand(*scores.shape[:2], queries, keys)
    return torch.gather(scores, 3, index)


class FeedForward(nn.Module):
    def __init__(self, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, hidden)
        self.w_2 = nn.Linear(hidden, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(F.silu(self.w_1(x)))


class ConformerBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int, hidden: int) -> None:
        super().__init__()
        self.self_attn = RelPositionSelfAttention(n_head, d_model)
        self.feed_forward = FeedForward(d_model, hidden)
        self.norm_mha = nn.LayerNorm(d_model, eps=1e-5)
        self.norm_ff = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, pos_table: torch.Tensor,
                cache: FrameCache | None = None) -> torch.Tensor:
        x = x + self.self_attn(self.norm_mha(x), mask, pos_table, cache)
        return x + self.feed_forward(self.norm_ff(x))
