"""Read a prompt recording from a RIFF/WAVE file as mono float32 at the rate a feature needs.

Python's `wave` module reads integer PCM only, and prompt files are often IEEE float (format 3) or
WAVE_FORMAT_EXTENSIBLE, so the RIFF chunks are parsed here (soundfile is not a dependency).
Channels are averaged and the rate converted with soxr, as the official `load_wav` averages
channels and resamples (with torchaudio's sinc resampler: results agree to resampler precision,
not bit for bit).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soxr
import torch

_PCM = 1
_IEEE_FLOAT = 3
_EXTENSIBLE = 0xFFFE


class WavFormatError(ValueError):
    pass


@dataclass(frozen=True)
class WavAudio:
    samples: np.ndarray  # (frames, channels) float32 in [-1, 1]
    sample_rate: int


def read_wav(path: str | Path) -> WavAudio:
    data = Path(path).read_bytes()
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        raise WavFormatError(f"{path}: not a RIFF/WAVE file")
    fmt: tuple[int, int, int, int] | None = None
    payload: bytes | None = None
    pos = 12
    while pos + 8 <= len(data):
        chunk_id, size = data[pos:pos + 4], struct.unpack_from("<I", data, pos + 4)[0]
        body = data[pos + 8:pos + 8 + size]
        if chunk_id == b"fmt ":
            tag, channels, rate = struct.unpack_from("<HHI", body, 0)
            bits = struct.unpack_from("<H", body, 14)[0]
            if tag == _EXTENSIBLE and len(body) >= 26:
                tag = struct.unpack_from("<H", body, 24)[0]  # first two bytes of the sub-format GUID
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            payload = body
        pos += 8 + size + (size & 1)  # chunks are word-aligned
    if fmt is None or payload is None:
        raise WavFormatError(f"{path}: missing {'fmt' if fmt is None else 'data'} chunk")
    tag, channels, rate, bits = fmt
    return WavAudio(_decode(payload, tag, bits, path).reshape(-1, channels), rate)


def _decode(payload: bytes, tag: int, bits: int, path: str | Path) -> np.ndarray:
    if tag == _IEEE_FLOAT and bits in (32, 64):
        return np.frombuffer(payload, dtype=f"<f{bits // 8}").astype(np.float32)
    if tag == _PCM and bits == 8:
        return (np.frombuffer(payload, dtype=np.uint8).astype(np.float32) - 128) / 128
    if tag == _PCM and bits in (16, 32):
        return np.frombuffer(payload, dtype=f"<i{bits // 8}").astype(np.float32) / 2 ** (bits - 1)
    if tag == _PCM and bits == 24:
        raw = np.frombuffer(payload, dtype=np.uint8).reshape(-1, 3).astype(np.int32)
        value = raw[:, 0] | (raw[:, 1] << 8) | (raw[:, 2] << 16)
        value = np.where(value >= 1 << 23, value - (1 << 24), value)
        return value.astype(np.float32) / 2 ** 23
    raise WavFormatError(f"{path}: unsupported WAVE encoding (format tag {tag}, {bits} bits)")


def resample(wav: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Mono float32 (N,) -> (M,) at `to_rate`."""
    if from_rate == to_rate:
        return wav.astype(np.float32, copy=False)
    return soxr.resample(wav.astype(np.float32, copy=False), from_rate, to_rate, quality="VHQ").astype(np.float32)


def load_wav(path: str | Path, sample_rate: int) -> torch.Tensor:
    """Mono float32 waveform (N,) at `sample_rate`."""
    audio = read_wav(path)
    mono = audio.samples.mean(axis=1, dtype=np.float32) if audio.samples.shape[1] > 1 else audio.samples[:, 0]
    return torch.from_numpy(np.ascontiguousarray(resample(mono, audio.sample_rate, sample_rate)))
