"""Streaming sample-rate conversion of engine audio to the line's rate (python-soxr): 24 kHz -> 8 kHz for G.711,
24 kHz -> 16 kHz for G.722.

One `Resampler` per stream: chunks go in as they arrive, line-rate audio comes out with the filter state carried
across chunk boundaries (no clicks at seams), and `flush()` drains the filter tail at the end of the stream.
Quality 'HQ' is the latency trade-off: its filter delays the audio by ~17 ms against ~60 ms for 'VHQ', and
first-packet latency is what callers hear; HQ's passband (to ~3.8 kHz at 8 kHz out, ~7.6 kHz at 16 kHz) is already
wider than each codec's band.
"""

from __future__ import annotations

import numpy as np
import soxr

TARGET_RATE = 8000  # G.711's clock (RFC 3551 §4.5.14); G.722 lines pass target_rate=16000


class Resampler:
    """Engine rate (24 kHz for CosyVoice2, other rates accepted) -> `target_rate` float32 mono."""

    def __init__(self, source_rate: int = 24000, target_rate: int = TARGET_RATE, quality: str = "HQ") -> None:
        self.source_rate = source_rate
        self.target_rate = target_rate
        self._stream = (
            soxr.ResampleStream(source_rate, target_rate, 1, dtype="float32", quality=quality)
            if source_rate != target_rate else None
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
