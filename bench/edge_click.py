"""The click measure of a stream's edges: the largest sample-to-sample jump in its first and last 20 ms,
counting the step from and to the silence around it, over the largest jump in the rest of the stream.

A click is an edge jump as large as the loudest moment's (ratio near 1 or above); a stream that fades in and
out measures well under it (CosyVoice3's tiny model: 0.05-0.09 at the start). The end's window also holds
whatever the last 20 ms say: a random-weight model speaks to its last token, so its end measures the content
as much as a cut (tiny model, float32, CPU: 0.07-0.94 over 16 streams); `step`, the first and last samples
against silence, is the cut alone. Measured on 16-bit PCM, as a listener gets it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EDGE_MS = 20


@dataclass(frozen=True)
class EdgeJumps:
    start: float  # the first 20 ms' largest jump (from silence included) over the rest's
    end: float  # the last 20 ms' (to silence included)
    step: float  # the larger of |first sample| and |last sample| over the rest's largest jump


def edge_jumps(audio: np.ndarray, sample_rate: int = 24_000) -> EdgeJumps:
    """`audio`: the stream's samples in [-1, 1] (float) or as int16 / 32768; silence assumed before and after."""
    edge = sample_rate * EDGE_MS // 1000
    jumps = np.abs(np.diff(np.concatenate([[0.0], audio.astype(np.float64), [0.0]])))
    rest = jumps[edge + 1:-edge - 1].max()
    return EdgeJumps(float(jumps[:edge + 1].max() / rest), float(jumps[-edge - 1:].max() / rest),
                     float(max(jumps[0], jumps[-1]) / rest))


def edge_jump_ratio(audio: np.ndarray, sample_rate: int = 24_000) -> float:
    """The larger of the start's and the end's ratio (README's CosyVoice3 click figure)."""
    jumps = edge_jumps(audio, sample_rate)
    return max(jumps.start, jumps.end)
