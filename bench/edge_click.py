"""The click measure of a stream's edges: the largest sample-to-sample jump in its first and last 20 ms,
counting the step from and to the silence around it, over the largest jump in the rest of the stream.

A click is an edge jump as large as the loudest moment's (ratio near 1 or above); a stream that fades in and
out measures well under it (CosyVoice3's tiny model: 0.05-0.09). Measured on 16-bit PCM, as a listener gets it.
"""

from __future__ import annotations

import numpy as np

EDGE_MS = 20


def edge_jump_ratio(audio: np.ndarray, sample_rate: int = 24_000) -> float:
    """`audio`: the stream's samples in [-1, 1] (float) or as int16 / 32768; silence assumed before and after."""
    edge = sample_rate * EDGE_MS // 1000
    jumps = np.abs(np.diff(np.concatenate([[0.0], audio.astype(np.float64), [0.0]])))
    edges = max(jumps[:edge + 1].max(), jumps[-edge - 1:].max())
    return float(edges / jumps[edge + 1:-edge - 1].max())
