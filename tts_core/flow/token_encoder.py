"""The flow's token encoder: speech-token embeddings -> per-mel-frame conditioning (`mu`).

Stage 1 runs at the token rate: input layer, a pre-lookahead convolution that lets each token see
the next `pre_lookahead_len` tokens, then conformer blocks. An upsampling convolution repeats every
token `up_stride` times (the token-to-mel ratio) and stage 2 runs conformer blocks at the mel rate.
In streaming mode both stages use chunk-causal attention (`chunk_attention_mask`), chunks of
`static_chunk_size` tokens and `static_chunk_size * up_stride` frames.

When a streaming call is not the final one, the caller passes the last `pre_lookahead_len` tokens
as `context`: they feed the lookahead convolution of the tokens before them but get no output row
of their own (the official code renders them in the next call, once their own lookahead exists).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from tts_core.flow.chunk_mask import chunk_attention_mask
from tts_core.flow.config import EncoderConfig
from tts_core.flow.conformer import ConformerBlock, LinearInput, relative_position_table
from tts_core.flow.frame_cache import FrameCache


class PreLookahead(nn.Module):
    """Residual two-convolution block: the first sees `pre_lookahead_len` future tokens, the second
    two past ones."""

    def __init__(self, channels: int, hidden: int, pre_lookahead_len: int) -> None:
        super().__init__()
        self.pre_lookahead_len = pre_lookahead_len
        self.conv1 = nn.Conv1d(channels, hidden, kernel_size=pre_lookahead_len + 1)
        self.conv2 = nn.Conv1d(hidden, channels, kernel_size=3)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None,
                cache: FrameCache | None = None) -> torch.Tensor:
        """x (B, T, C); context (B, pre_lookahead_len, C) already through the input layer, or None
        (zeros stand in for the future). With a cache, x continues the tokens before it."""
        h = x.transpose(1, 2)
        if context is None:
            h = F.pad(h, (0, self.pre_lookahead_len))
        else:
            if context.size(1) != self.pre_lookahead_len:
                raise ValueError(f"lookahead context must be {self.pre_lookahead_len} tokens, got {context.size(1)}")
            h = torch.cat([h, context.transpose(1, 2)], dim=2)
        h = F.leaky_relu(self.conv1(h))
        n = self.conv2.kernel_size[0] - 1
        h = F.pad(h, (n, 0)) if cache is None else cache.conv_input(self, h, n)
        return self.conv2(h).transpose(1, 2) + x


class RepeatUpsample(nn.Module):
    """Nearest-neighbour repeat by `stride`, then a causal convolution over 2*stride+1 frames."""

    def __init__(self, in_channels: int, out_channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv1d(in_channels, out_channels, stride * 2 + 1)

    def forward(self, x: torch.Tensor, cache: FrameCache | None = None) -> torch.Tensor:
        """x (B, C, T) -> (B, C_out, T*stride); the cache (at the output rate) holds the repeated
        frames before x."""
        h = torch.repeat_interleave(x, self.stride, dim=2)
        n = self.stride * 2
        return self.conv(F.pad(h, (n, 0)) if cache is None else cache.conv_input(self, h, n))


class TokenEncoder(nn.Module):
    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        if cfg.up_channels != cfg.output_size:
            raise ValueError(f"flow.pt: upsample layer outputs {cfg.up_channels} channels, encoder width is "
                             f"{cfg.output_size}")
        self.cfg = cfg
        d = cfg.output_size
        self.embed = LinearInput(cfg.input_size, d)
        self.pre_lookahead_layer = PreLookahead(d, cfg.lookahead_channels, cfg.pre_lookahead_len)
        self.encoders = nn.ModuleList(ConformerBlock(d, cfg.attention_heads, cfg.linear_units)
                                      for _ in range(cfg.num_blocks))
        self.up_layer = RepeatUpsample(d, cfg.up_channels, cfg.up_stride)
        # The official module builds `up_embed` with the *input* size; CosyVoice2 has input == output.
        self.up_embed = LinearInput(cfg.input_size, d)
        self.up_encoders = nn.ModuleList(ConformerBlock(d, cfg.attention_heads, cfg.linear_units)
                                         for _ in range(cfg.num_up_blocks))
        self.after_norm = nn.LayerNorm(d, eps=1e-5)

    @staticmethod
    def _stage(x: torch.Tensor, blocks: nn.ModuleList, chunk: int, streaming: bool,
               cache: FrameCache | None) -> torch.Tensor:
        start = cache.start if cache is not None else 0
        total = start + x.size(1)
        mask = chunk_attention_mask(total, chunk, -1, x.device)[start:] if streaming and chunk > 0 else None
        pos = relative_position_table(total, x.size(2), x.device, x.dtype)
        for block in blocks:
            x = block(x, mask, pos, cache)
        return x

    def forward(self, tokens_emb: torch.Tensor, streaming: bool, context_emb: torch.Tensor | None = None,
                token_cache: FrameCache | None = None, frame_cache: FrameCache | None = None) -> torch.Tensor:
        """tokens_emb (B, T, input_size) -> (B, T*up_stride, output_size).

        With caches (token rate, mel-frame rate) the tokens continue those of earlier passes and
        only their frames are returned; streaming must then be True (only chunk-causal attention
        lets earlier frames stay fixed)."""
        if (token_cache is None) != (frame_cache is None) or (token_cache is not None and not streaming):
            raise ValueError("token encoder: pass both caches, and only in streaming mode")
        x = self.embed(tokens_emb)
        context = self.embed(context_emb) if context_emb is not None else None
        x = self.pre_lookahead_layer(x, context, token_cache)
        x = self._stage(x, self.encoders, self.cfg.static_chunk_size, streaming, token_cache)
        x = self.up_layer(x.transpose(1, 2), frame_cache).transpose(1, 2)
        x = self.up_embed(x)
        x = self._stage(x, self.up_encoders, self.cfg.static_chunk_size * self.cfg.up_stride, streaming, frame_cache)
        return self.after_norm(x)
