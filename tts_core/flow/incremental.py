"""Chunk-wise flow rendering whose per-call work does not grow with the utterance.

The official streaming caller re-runs the encoder and all 10 x 2 estimator passes over the prompt
and every token so far, on every call, and keeps only the new frames. In streaming mode every
attention is chunk-causal and every convolution causal, and the noise at a frame does not depend on
the call, so frames of completed chunks come out the same in every later call. This renderer
computes each frame once: it keeps, per causal layer, the keys/values and the last input frames
(`FrameCache`; one per time base and one per Euler step) and runs the network on new frames only.

What still grows: attention over all earlier keys (CosyVoice2 sees every left chunk), i.e. a dot
product per cached frame, and the cache itself (per Euler step, per estimator transformer block:
K and V for both guidance rows). Everything else (convolutions, projections, feed-forwards) is done
once per frame.

Equality with the official output needs each call to end on a chunk boundary (the default
schedule pads the first hop so that it does). If a call ends inside a chunk, that chunk's frames are
emitted as the official call renders them and recomputed next call, when the chunk has more keys,
exactly as the official re-run does; only whole chunks are ever cached.

Not thread-safe: one instance per request.
"""

from __future__ import annotations

import torch

from tts_core.flow.frame_cache import FrameCache
from tts_core.flow.model import FlowModel


class IncrementalFlow:
    def __init__(self, model: FlowModel, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor) -> None:
        """prompt_token (1, P) int, prompt_feat (1, frames, 80), embedding (1, 192)."""
        if prompt_token.size(0) != 1:
            raise ValueError("incremental flow takes batch 1")
        self.model = model
        cfg = model.cfg
        self._ratio = cfg.token_mel_ratio
        self._lookahead = cfg.pre_lookahead_len
        self._token_chunk = cfg.encoder.static_chunk_size
        if cfg.estimator.static_chunk_size != self._token_chunk * self._ratio:
            raise ValueError("incremental flow: encoder and estimator chunks must cover the same frames")
        if self._token_chunk <= 0:
            raise ValueError("incremental flow: the model has no static chunk size")
        self._prompt_token = prompt_token
        self._prompt_feat = prompt_feat
        self._emitted = prompt_feat.size(1)  # mel frames already returned (the prompt is never returned)
        with torch.inference_mode():
            self._spks = model.speaker(embedding)
        self._token_cache = FrameCache()
        self._frame_cache = FrameCache()
        self._step_caches = [FrameCache() for _ in range(cfg.n_timesteps)]
        self._finished = False

    @property
    def frames_emitted(self) -> int:
        """Mel frames returned so far, not counting the prompt."""
        return self._emitted - self._prompt_feat.size(1)

    def _caches(self) -> list[FrameCache]:
        return [self._token_cache, self._frame_cache, *self._step_caches]

    @torch.inference_mode()
    def render(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """tokens (1, N): every speech token of the request so far (the same tensor the official
        streaming call receives). Returns the mel frames (1, 80, new) not returned before; with
        finalize False the last `pre_lookahead_len` tokens are lookahead only."""
        if self._finished:
            raise RuntimeError("incremental flow: render called after the final call")
        model = self.model
        all_tokens = torch.cat([self._prompt_token, tokens], dim=1)
        end = all_tokens.size(1) if finalize else all_tokens.size(1) - self._lookahead
        start = self._token_cache.start
        if end < start or end * self._ratio < self._emitted:
            raise ValueError(f"incremental flow: {tokens.size(1)} tokens is fewer than already rendered")
        commit = end if finalize else end // self._token_chunk * self._token_chunk
        self._token_cache.begin(commit)
        self._frame_cache.begin(commit * self._ratio)
        for cache in self._step_caches:
            cache.begin(commit * self._ratio)

        emb = model.embed_tokens(all_tokens[:, start:end])
        context = None if finalize else model.embed_tokens(all_tokens[:, end:])
        h = model.encoder(emb, True, context, self._token_cache, self._frame_cache)
        mu = model.encoder_proj(h).transpose(1, 2).contiguous()

        a, e = start * self._ratio, end * self._ratio
        cond = torch.zeros_like(mu)
        prompt_frames = self._prompt_feat.size(1)
        if a < prompt_frames:
            upto = min(prompt_frames, e)
            cond[:, :, : upto - a] = self._prompt_feat[:, a:upto].transpose(1, 2).to(mu.dtype)
        mask = torch.ones(1, 1, e - a, device=mu.device, dtype=mu.dtype)
        noise = model.decoder.noise(e, mu.dtype)[:, :, a:]
        attn_mask = model.decoder.estimator.attention_mask(e, True, mu.device, start=a)
        mel = model.decoder.solve(noise, mu, mask, self._spks, cond, attn_mask, self._step_caches)

        for cache in self._caches():
            cache.finish()
        out = mel[:, :, self._emitted - a:]
        self._emitted = e
        self._finished = finalize
        return out
