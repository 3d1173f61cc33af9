"""When the next audio chunk of a request can be rendered, following the official CosyVoice2 schedule.

The official streaming loop renders a chunk once `hop + pre_lookahead` speech tokens beyond the last
rendered one exist. The first hop is padded so that prompt tokens plus the first hop fill whole
25-token chunks (the flow's chunk-aware attention masks are aligned to the prompt's start), and the
hop grows after the first chunk (25 -> 50 by default: a larger hop means fewer flow/HiFT calls and
fewer chunk seams, a smaller one lowers latency and keeps the buffer fuller early). The lookahead
tokens are fed to the flow's pre-lookahead convolution but not rendered until the next chunk.

Unlike the official code, which keeps the growing hop on the shared model object (so concurrent
requests change each other's hop), every request owns its `ChunkPlanner`.

Latency/quality trade-off of the knobs (all per-request):
- `first_hop_tokens` (default: the official `hop_tokens` + prompt pad). Fewer tokens -> the first audio
  needs fewer LLM decode steps (N + lookahead instead of 28), so it arrives sooner; but the first chunk
  then ends inside one of the flow's 25-token attention chunks, and its frames are rendered from that
  partial chunk (tiny golden model: mean |log-mel| difference ~0.06 over the first chunk against the
  official schedule's, bench/bench_first_hop.py, docs/PERF_NOTES.md). The second hop ends on the chunk
  grid again (the first grid point at least a first hop on), so every later frame is the official schedule's.
- `hop_tokens`/`max_hop_tokens`: after the first chunk the playout buffer already holds >= 1 s, so the
  default grows the hop for quality and efficiency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkSchedule:
    hop_tokens: int = 25
    max_hop_tokens: int = 50
    hop_scale: int = 2
    lookahead_tokens: int = 3
    first_hop_tokens: int | None = None  # None: hop_tokens plus the prompt-alignment pad (official)

    def __post_init__(self) -> None:
        if self.hop_tokens <= 0 or self.max_hop_tokens < self.hop_tokens:
            raise ValueError("chunk schedule: need 0 < hop_tokens <= max_hop_tokens")
        if self.hop_scale < 1 or self.lookahead_tokens < 0:
            raise ValueError("chunk schedule: need hop_scale >= 1 and lookahead_tokens >= 0")
        if self.first_hop_tokens is not None and self.first_hop_tokens <= 0:
            raise ValueError("chunk schedule: first_hop_tokens must be positive")


@dataclass(frozen=True)
class ChunkTask:
    """Render speech tokens [0, token_end) (lookahead included when not final), emitting mel frames
    from token `token_offset` on. `finalize` renders everything and flushes the vocoder caches."""

    index: int
    token_offset: int
    token_end: int
    finalize: bool


class ChunkPlanner:
    """Per-request chunk bookkeeping; not thread-safe (one request is served by one thread)."""

    def __init__(self, schedule: ChunkSchedule, prompt_tokens: int) -> None:
        self.schedule = schedule
        pad = math.ceil(prompt_tokens / schedule.hop_tokens) * schedule.hop_tokens - prompt_tokens
        self._first_hop = schedule.first_hop_tokens or schedule.hop_tokens + pad
        self._hop = schedule.hop_tokens
        self._prompt_tokens = prompt_tokens
        self.token_offset = 0
        self.chunks_emitted = 0
        self.done = False

    @property
    def next_hop(self) -> int:
        if self.chunks_emitted == 0:
            return self._first_hop
        grid = self.schedule.hop_tokens
        if self.chunks_emitted == 1 and (self._prompt_tokens + self.token_offset) % grid:
            # After a first hop off the chunk grid (`first_hop_tokens`), end the second chunk on it again, so
            # that no later call ends inside a chunk: the frames after the first chunk are then the official
            # schedule's. It ends at the first grid point at least as far on as the first hop (at most one
            # chunk): the short first chunk's audio must last until the second is rendered, so the second
            # waits for as few decode steps as that allows and holds at least as much speech. (The grid point
            # below the usual hop made it 40 tokens after a first hop of 10. Neither keeps a loaded GPU from
            # running dry: docs/PERF_NOTES.md, session 12.)
            reach = self._prompt_tokens + self.token_offset + min(self._first_hop, grid)
            return -(-reach // grid) * grid - self._prompt_tokens - self.token_offset
        return self._hop

    def tokens_needed(self) -> int:
        """How many tokens must exist before the next non-final chunk can be rendered."""
        return self.token_offset + self.next_hop + self.schedule.lookahead_tokens

    def next_chunk(self, tokens_available: int, lm_finished: bool) -> ChunkTask | None:
        """The chunk to render now, or None if it must wait for more tokens."""
        if self.done:
            return None
        if tokens_available >= self.tokens_needed():
            hop = self.next_hop
            task = ChunkTask(self.chunks_emitted, self.token_offset,
                             self.token_offset + hop + self.schedule.lookahead_tokens, finalize=False)
            self.token_offset += hop
            self.chunks_emitted += 1
            self._hop = min(self.schedule.max_hop_tokens, self._hop * self.schedule.hop_scale)
            return task
        if lm_finished:
            self.done = True
            task = ChunkTask(self.chunks_emitted, self.token_offset, tokens_available, finalize=True)
            self.chunks_emitted += 1
            return task
        return None
