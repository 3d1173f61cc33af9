"""Slaney-style triangular mel filterbanks, equal to `librosa.filters.mel` (htk=False, norm="slaney").

Both the Matcha prompt mel and Whisper's log-mel were computed upstream with librosa's filters; we
rebuild them in numpy rather than depend on librosa. The arithmetic follows librosa's order (float64
ramps stored into a float32 matrix, then scaled by the float64 area norm) so the float32 result
matches to the last bit or two.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

# Slaney's Auditory Toolbox scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
_LINEAR_HZ_PER_MEL = 200.0 / 3
_BREAK_HZ = 1000.0
_BREAK_MEL = _BREAK_HZ / _LINEAR_HZ_PER_MEL
_LOG_STEP = np.log(6.4) / 27.0


def hz_to_mel(hz: np.ndarray) -> np.ndarray:
    hz = np.asanyarray(hz, dtype=np.float64)
    mel = hz / _LINEAR_HZ_PER_MEL
    above = hz >= _BREAK_HZ
    return np.where(above, _BREAK_MEL + np.log(np.maximum(hz, _BREAK_HZ) / _BREAK_HZ) / _LOG_STEP, mel)


def mel_to_hz(mel: np.ndarray) -> np.ndarray:
    mel = np.asanyarray(mel, dtype=np.float64)
    hz = _LINEAR_HZ_PER_MEL * mel
    above = mel >= _BREAK_MEL
    return np.where(above, _BREAK_HZ * np.exp(_LOG_STEP * (mel - _BREAK_MEL)), hz)


@lru_cache(maxsize=8)
def _filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float, fmax: float) -> np.ndarray:
    fft_hz = np.fft.rfftfreq(n_fft, d=1.0 / sample_rate)
    edges_hz = mel_to_hz(np.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2))
    widths = np.diff(edges_hz)
    ramps = edges_hz[:, None] - fft_hz[None, :]
    weights = np.zeros((n_mels, fft_hz.shape[0]), dtype=np.float32)
    for i in range(n_mels):
        rising = -ramps[i] / widths[i]
        falling = ramps[i + 2] / widths[i + 1]
        weights[i] = np.maximum(0, np.minimum(rising, falling))
    # Slaney normalisation: every triangle has unit area in Hz, so band energy is comparable.
    weights *= (2.0 / (edges_hz[2:n_mels + 2] - edges_hz[:n_mels]))[:, None]
    weights.setflags(write=False)
    return weights


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int, fmin: float = 0.0,
                   fmax: float | None = None) -> torch.Tensor:
    """(n_mels, n_fft // 2 + 1) float32; `fmax=None` means the Nyquist frequency."""
    top = float(sample_rate) / 2 if fmax is None else float(fmax)
    return torch.from_numpy(_filterbank(int(sample_rate), int(n_fft), int(n_mels), float(fmin), top).copy())
