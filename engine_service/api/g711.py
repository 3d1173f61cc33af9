"""G.711 u-law and A-law encoding (ITU-T G.711) for the API's pcmu/pcma formats, as numpy lookups.

The worker process must not import the gateway package (they are separate processes with separate
dependencies), so it carries its own encoder. Both laws are applied to 16-bit linear PCM through one
65536-entry table per law, built at import from the segment rules of the Sun reference code that `audioop`
used (audioop itself is gone in Python 3.13). tests/engine_service/api/test_g711.py checks every input value
against gateway.media.g711, so the two encoders cannot drift apart.
"""

from __future__ import annotations

import numpy as np

_ULAW_SEGMENT_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENT_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _every_pcm16() -> np.ndarray:
    return np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)


def _ulaw_table() -> np.ndarray:
    value = _every_pcm16() >> 2  # u-law works on 14-bit samples
    magnitude = np.minimum(np.abs(value), 8159) + 33  # clip, then add the bias (0x84 >> 2)
    segment = np.searchsorted(_ULAW_SEGMENT_ENDS, magnitude)
    code = np.where(segment >= 8, 0x7F,
                    (segment << 4) | ((magnitude >> (np.minimum(segment, 7) + 1)) & 0xF))
    return (code ^ np.where(value < 0, 0x7F, 0xFF)).astype(np.uint8)


def _alaw_table() -> np.ndarray:
    value = _every_pcm16() >> 3  # A-law works on 13-bit samples
    magnitude = np.where(value >= 0, value, -value - 1)
    segment = np.searchsorted(_ALAW_SEGMENT_ENDS, magnitude)
    shift = np.where(segment < 2, 1, np.minimum(segment, 7))
    code = np.where(segment >= 8, 0x7F, (np.minimum(segment, 7) << 4) | ((magnitude >> shift) & 0xF))
    return (code ^ np.where(value >= 0, 0xD5, 0x55)).astype(np.uint8)  # sign bit, even bits inverted


_TABLES = {"pcmu": _ulaw_table(), "pcma": _alaw_table()}


def encode_g711(pcm16: np.ndarray, law: str) -> bytes:
    """int16 samples -> one G.711 byte each; `law` is 'pcmu' or 'pcma'."""
    return _TABLES[law].take(pcm16.view(np.uint16)).tobytes()
