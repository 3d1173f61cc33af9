"""24 kHz engine audio -> 8 kHz telephone audio, streamed chunk by chunk."""

from __future__ import annotations

import numpy as np

from speech_audio.resample import Resampler


def test_1khz_tone_keeps_length_energy_and_frequency() -> None:
    t = np.arange(24000) / 24000
    tone = (0.5 * np.sin(2 * np.pi * 1000 * t)).astype(np.float32)
    resampler = Resampler()
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, 24000), size=30, replace=False))
    out = np.concatenate([resampler.push(c) for c in np.split(tone, cuts)] + [resampler.flush()])
    assert out.dtype == np.float32 and out.size == 8000
    body = out[400:-400]
    assert abs(np.sqrt(np.mean(body**2)) - 0.5 / np.sqrt(2)) < 0.01
    spectrum = np.abs(np.fft.rfft(out))
    assert abs(np.argmax(spectrum) * 8000 / out.size - 1000) <= 1


def test_8khz_input_passes_through() -> None:
    audio = np.arange(100, dtype=np.float32)
    resampler = Resampler(source_rate=8000, target_rate=8000)
    assert np.array_equal(resampler.push(audio), audio) and resampler.flush().size == 0
