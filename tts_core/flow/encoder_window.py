"""The flow encoder over a window of tokens: mu for the new frames of a chunk-wise call.

The encoder is chunk-causal with a `pre_lookahead_len`-token lookahead, so the frames of a call
depend on the tokens from a chunk-aligned window start up to the call's end (lookahead included
when not final). From the first token on it is the official computation; a later window start
(`PooledFlow(encoder_tokens=...)`) gives every call of a schedule one static shape, at the cost of
the context before the window (measured at full size: 0.2 % relative mel for a 25-token window,
docs/PERF_NOTES.md). The encoder runs once per call, not per Euler step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from tts_core.flow.model import FlowModel


class EncoderCall(Protocol):
    enc_tokens: torch.Tensor  # (1, n) token ids from the window start, lookahead included if not final
    finalize: bool

    @property
    def new_frames(self) -> int: ...


def encode_new_frames(model: FlowModel, enc_tokens: torch.Tensor, finalize: bool, new_frames: int) -> torch.Tensor:
    """enc_tokens (B, n) of equal length -> mu (B, 80, new_frames) of the last `new_frames` frames.
    No host syncs (capturable, given device-side position tables)."""
    emb = model.embed_tokens(enc_tokens)
    if finalize:
        h = model.encoder(emb, True)
    else:
        k = model.cfg.pre_lookahead_len
        h = model.encoder(emb[:, :-k], True, context_emb=emb[:, -k:])
    return model.encoder_proj(h[:, h.size(1) - new_frames:]).transpose(1, 2).contiguous()


def encode_grouped(model: FlowModel, plans: Sequence[EncoderCall], encode=None) -> list[torch.Tensor]:
    """mu (80, new frames) per plan; plans of equal (tokens, new frames, finalize) share one call
    of `encode(model, tokens (B, n), finalize, new_frames)` (default `encode_new_frames`)."""
    encode = encode or encode_new_frames
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for i, p in enumerate(plans):
        groups.setdefault((p.enc_tokens.size(1), p.new_frames, p.finalize), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(plans)
    for (_, new_frames, fin), members in groups.items():
        mu = encode(model, torch.cat([plans[i].enc_tokens for i in members]), fin, new_frames)
        for row, i in enumerate(members):
            out[i] = mu[row]
    return out  # type: ignore[return-value]
