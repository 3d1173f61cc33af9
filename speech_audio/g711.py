"""G.711 u-law and A-law (ITU-T G.711) encode/decode as numpy table lookups.

Both laws are defined on 16-bit linear PCM; encoding is one 65536-entry lookup indexed by the sample's
bit pattern, decoding one 256-entry lookup. The tables are computed once at import from the segment
rules of G.711 (the same rules as the classic Sun reference code that `audioop` used), so the output
is byte-identical to `audioop.lin2ulaw` / `lin2alaw`. This module is on the gateway's per-packet hot path: keep
it to a handful of vector operations per 160-sample frame.
"""

from __future__ import annotations

import numpy as np

_ULAW_BIAS = 0x84 >> 2  # 33: the u-law bias in the 14-bit domain the encoder works in
_ULAW_CLIP = 8159  # largest 14-bit magnitude u-law represents


def _segment(magnitude: np.ndarray, segment_ends: tuple[int, ...]) -> np.ndarray:
    """Index of the first segment whose end is >= magnitude (8 when beyond the last)."""
    return np.searchsorted(np.asarray(segment_ends), magnitude, side="left")


def _build_ulaw_encode() -> np.ndarray:
    pcm16 = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)
    value = pcm16 >> 2  # u-law quantises 14-bit linear samples
    mask = np.where(value < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(value), _ULAW_CLIP) + _ULAW_BIAS
    seg = _segment(magnitude, (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF))
    code = np.where(seg >= 8, 0x7F, (seg << 4) | ((magnitude >> (np.minimum(seg, 7) + 1)) & 0xF))
    return (code ^ mask).astype(np.uint8)


def _build_alaw_encode() -> np.ndarray:
    pcm16 = np.arange(65536, dtype=np.uint16).view(np.int16).astype(np.int32)
    value = pcm16 >> 3  # A-law quantises 13-bit linear samples
    mask = np.where(value >= 0, 0xD5, 0x55)  # sign bit set for positive, even bits inverted
    magnitude = np.where(value >= 0, value, -value - 1)
    seg = _segment(magnitude, (0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF))
    shift = np.where(seg < 2, 1, np.minimum(seg, 7))
    code = np.where(seg >= 8, 0x7F, (np.minimum(seg, 7) << 4) | ((magnitude >> shift) & 0xF))
    return (code ^ mask).astype(np.uint8)


def _build_ulaw_decode() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    t = (((code & 0x0F) << 3) + 0x84) << ((code & 0x70) >> 4)
    return np.where(code & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _build_alaw_decode() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    seg = (code & 0x70) >> 4
    t = (code & 0x0F) << 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(code & 0x80, t, -t).astype(np.int16)


_ENCODE = {"PCMU": _build_ulaw_encode(), "PCMA": _build_alaw_encode()}
_DECODE = {"PCMU": _build_ulaw_decode(), "PCMA": _build_alaw_decode()}
CODECS = tuple(_ENCODE)


def float_to_pcm16(samples: np.ndarray) -> np.ndarray:
    """float32 in [-1, 1) -> int16, rounded and clipped (out-of-range audio saturates, never wraps)."""
    return np.clip(np.rint(samples * 32768.0), -32768, 32767).astype(np.int16)


def encode(samples: np.ndarray, codec: str) -> bytes:
    """Encode float32 ([-1, 1)) or int16 samples with `codec` ('PCMU' or 'PCMA') -> one byte per sample."""
    if samples.dtype != np.int16:
        samples = float_to_pcm16(samples)
    return _ENCODE[codec].take(samples.view(np.uint16)).tobytes()


def decode(payload: bytes, codec: str) -> np.ndarray:
    """G.711 bytes -> int16 samples."""
    return _DECODE[codec].take(np.frombuffer(payload, dtype=np.uint8))

