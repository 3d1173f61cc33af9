"""Requests' streaming vocoders that replay captured HiFT graphs, one chunk of many streams per replay.

Same glue as `HiftStream` (8-frame mel cache, 3840-sample source cache, Hamming cross-fade, held-back
tail); only the F0 + source + decode call is swapped for a `GraphedHift`. A lane's graphs are keyed
(rows, mel frames incl. cache, cached source samples): `push_chunks` stacks the chunks of one shape
(the steady later chunk of every stream in a call) into one replay of the smallest bucket that
holds them, and runs the rest one by one, graphed where a one-row graph of their shape exists (first
chunks, final chunks by length) and eagerly otherwise. Every row of HiFT is independent of the
others, so a batched replay gives each stream what its own call would.

A graph draws its excitation noise from a generator of its own, not the job's seeded one: graphed
chunks are not reproducible by seed (the eager path is).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence

import structlog
import torch

from tts_core.accel.graph_capture import miss_worth_logging
from tts_core.hift import HiftStream

log = structlog.get_logger(__name__)

HiftGraphs = dict[tuple[int, int, int], object]  # (rows, frames incl. cache, cached samples) -> GraphedHift

# Chunks that found no graph of their shape while a lane had graphs, by shape (frames incl. cache, cached
# samples): each runs the vocoder's few hundred kernels eagerly on the render thread. A process-wide tally, for
# the log only.
_eager_by_shape: Counter = Counter()


class ChunkVocoder(HiftStream):
    """A HiftStream whose vocoder call `push_chunks` may replace by a row of a graph replay."""

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the caches as used on `stream` (another rendering lane takes this vocoder over)."""
        for cached in (self._mel, self._source, self._speech):
            if cached is not None:
                cached.record_stream(stream)

    def shape(self, new_frames: int) -> tuple[int, int]:
        """(mel frames incl. the cache, cached source samples) of a chunk of `new_frames`."""
        cached_frames = 0 if self._mel is None else self._mel.shape[-1]
        return new_frames + cached_frames, 0 if self._source is None else self._source.shape[-1]

    def with_cache(self, mel_chunk: torch.Tensor) -> torch.Tensor:
        return mel_chunk if self._mel is None else torch.cat([self._mel, mel_chunk], dim=2)

    def settle(self, mel: torch.Tensor, wav: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """After the vocoder call on `mel` (cache included): cross-fade, keep the caches, return the
        final part. Copies everything it keeps: `wav`/`source` may be a graph's outputs, which the
        next replay overwrites."""
        if self._speech is not None:
            wav = self._cross_fade(wav, self._speech)
        if finalize:
            self.finished = True
            self._mel = self._source = self._speech = None
            return wav.clone()
        self._mel = mel[..., -self.mel_cache_frames:].clone()
        self._source = source[..., -self.source_cache_samples:].clone()
        self._speech = wav[..., -self.source_cache_samples:].clone()
        return wav[..., :-self.source_cache_samples].clone()


@torch.inference_mode()
def push_chunks(vocoders: Sequence[ChunkVocoder], mel_chunks: Sequence[torch.Tensor], finalize: Sequence[bool],
                graphs: HiftGraphs) -> list[torch.Tensor]:
    """One chunk (1, 80, T_i) per vocoder (distinct streams) -> each one's final waveform, in order."""
    out: list[torch.Tensor | None] = [None] * len(vocoders)

    def replay(part: list[int], key: tuple[int, int, int]) -> None:
        mels = [vocoders[i].with_cache(mel_chunks[i]) for i in part]
        caches = [vocoders[i]._source for i in part]
        wav, source = graphs[key].inference(torch.cat(mels), None if caches[0] is None else torch.cat(caches))
        for row, i in enumerate(part):
            out[i] = vocoders[i].settle(mels[row], wav[row:row + 1], source[row:row + 1], finalize[i])

    by_shape: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, (vocoder, mel) in enumerate(zip(vocoders, mel_chunks)):
        by_shape[vocoder.shape(mel.shape[-1])].append(i)
    for shape, rows in by_shape.items():
        buckets = sorted(r for r, *key in graphs if tuple(key) == shape and r > 1)
        while len(rows) > 1 and buckets:
            fit = [b for b in buckets if b >= len(rows)]
            size = fit[0] if fit else buckets[-1]
            part, rows = rows[:size], rows[size:]
            replay(part, (size, *shape))
        for i in rows:  # alone: a one-row graph of its shape, else the eager vocoder
            if (1, *shape) in graphs:
                replay([i], (1, *shape))
            else:
                if graphs:
                    _eager_by_shape[shape] += 1
                    count = _eager_by_shape[shape]
                    if miss_worth_logging(count, first=3):
                        log.warning("hift_chunk_eager", frames=shape[0], cached=shape[1], eager_chunks=count)
                out[i] = vocoders[i].push(mel_chunks[i], finalize[i])
    return out  # type: ignore[return-value]
