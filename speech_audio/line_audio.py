"""An engine's stream made line audio: resampled to the line's rate, at the voice's fixed gain under the peak
limiter, as 16-bit PCM (what G.711 encodes and what the prompt cache keeps).

Every way speech leaves (a SIP call, a cached prompt's fill, the speech API) converts through `LineAudio`, so the
level on the line is the same whichever way in asked for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import numpy as np

from speech_audio.g711 import float_to_pcm16
from speech_audio.level import LineLevel
from speech_audio.resample import Resampler


class LineAudio:
    """float32 chunks at `source_rate` in, int16 chunks at `line_rate` out; `gain_db` None leaves the level as the
    engine made it (no gain, no limiter: only 16-bit saturation)."""

    def __init__(self, source_rate: int, line_rate: int, gain_db: float | None) -> None:
        self._resampler = Resampler(source_rate, line_rate)
        self.level = LineLevel(gain_db, line_rate) if gain_db is not None else None

    def push(self, chunk: np.ndarray) -> np.ndarray:
        return self._line(self._resampler.push(chunk))

    def flush(self) -> np.ndarray:
        return self._line(self._resampler.flush())

    def _line(self, samples: np.ndarray) -> np.ndarray:
        if self.level is not None:
            samples = self.level.apply(samples)
        return float_to_pcm16(samples)


async def line_chunks(chunks: AsyncIterable[np.ndarray], line: LineAudio) -> AsyncIterator[np.ndarray]:
    """The stream's chunks converted as they arrive, then the resampler's tail; empty chunks are skipped."""
    async for chunk in chunks:
        pcm = line.push(chunk)
        if pcm.size:
            yield pcm
    tail = line.flush()
    if tail.size:
        yield tail
