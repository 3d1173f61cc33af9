"""Streaming sample-rate conversion of engine audio to the 8 kHz of G.711 (python-soxr).

One `Resampler24kTo8k` per prompt: chunks go in as they arrive, 8 kHz audio comes out with the filter
state carried across chunk boundaries (no clicks at seams), and `flush()` drains the filter tail at the
end of the stream. Quality 'HQ' is the latency trade-off: its filter delays the audio by ~17 ms
against ~60 ms for 'VHQ', and first-packet latency is what callers hear; HQ's passband (to ~3.8 kHz at
8 kHz out) is already wider than the telephone band.
"""

from __future__ import annotations

import numpy as np
import soxr

TARGET_RATE = 8000


class Resampler24kTo8k:
    """Engine rate (24 kHz for CosyVoice2, other rates accepted) -> 8 kHz float32 mono."""

    def __init__(self, source_rate: int = 24000, quality: str = "HQ") -> None:
        self.source_rate = source_rate
        self._stream = (
            soxr.ResampleStream(source_rate, TARGET_RATE, 1, dtype="float32", quality=quality)
            if source_rate != TARGET_RATE else None
        )

    def push(self, chunk: np.ndarray) -> np.ndarray:
        samples = np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1)
        if self._stream is None:
            return samples
        return self._stream.resample_chunk(samples)

    def flush(self) -> np.ndarray:
        """The filter's remaining output; call once, at the end of the stream."""
        if self._stream is None:
            return np.zeros(0, dtype=np.float32)
        return self._stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
