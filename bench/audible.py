"""When audio becomes audible: the first 20 ms frame whose RMS is at or over a level in dBFS (0 dBFS: an RMS
of 32768), for RTP G.711 payloads and 16-bit PCM streams alike.

First *audible* audio, not first packet or first byte: a server that sends silence (or near-silence) early
would otherwise look fast to a listener who hears nothing. -40 dBFS is about 20 dB under conversational
speech on a phone line and well over a codec's or a model's silence floor (G.711 silence decodes to 0).
"""

from __future__ import annotations

import numpy as np

from speech_audio.g711 import decode

AUDIBLE_DBFS = -40.0
FRAME_MS = 20
_G711 = {0: "PCMU", 8: "PCMA"}  # RTP static payload types (RFC 3551 §6)


def frame_dbfs(samples: np.ndarray) -> float:
    """RMS level of int16 samples in dB relative to full scale (-inf for digital silence)."""
    if not len(samples):
        return float("-inf")
    rms = float(np.sqrt(np.mean(np.square(samples.astype(np.float64)))))
    return 20.0 * np.log10(rms / 32768.0) if rms > 0 else float("-inf")


def g711_audible(payload: bytes, payload_type: int, threshold_dbfs: float = AUDIBLE_DBFS) -> bool:
    """Is this RTP payload (PCMU or PCMA) an audible frame? Other payload types never are."""
    codec = _G711.get(payload_type)
    return codec is not None and frame_dbfs(decode(payload, codec)) >= threshold_dbfs


def first_audible_sample(pcm16: np.ndarray, sample_rate: int, threshold_dbfs: float = AUDIBLE_DBFS) -> int | None:
    """Index of the first sample of the first audible 20 ms frame of a stream (frames counted from its start;
    an incomplete last frame counts), or None."""
    frame = sample_rate * FRAME_MS // 1000
    for start in range(0, len(pcm16), frame):
        if frame_dbfs(pcm16[start:start + frame]) >= threshold_dbfs:
            return start
    return None
