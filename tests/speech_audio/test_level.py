"""Line level: the dBm0 reference of G.711, the active speech level, a fixed gain and a limiter that never lets a
sample past its ceiling."""

from __future__ import annotations

import numpy as np
import pytest

from speech_audio import g711
from speech_audio.level import (LineLevel, active_speech_dbm0, dbm0_of_rms, gain_db_for, peak_of_dbm0,
                                rms_of_dbm0)
from speech_audio.line_audio import LineAudio

RATE = 8000


def _sine(dbm0: float, seconds: float = 1.0, hz: float = 1004.0) -> np.ndarray:
    t = np.arange(int(seconds * RATE)) / RATE
    return (peak_of_dbm0(dbm0) * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def test_a_full_scale_sine_is_plus_3_17_dbm0_and_the_digital_milliwatt_is_0():
    assert dbm0_of_rms(np.sqrt(0.5)) == pytest.approx(3.17, abs=1e-9)
    # G.711 Table 6: the mu-law digital milliwatt is the 8-byte sequence 1E 0B 0B 1E 9E 8B 8B 9E repeated
    milliwatt = g711.decode(bytes([0x1E, 0x0B, 0x0B, 0x1E, 0x9E, 0x8B, 0x8B, 0x9E]) * 1000, "PCMU") / 32768.0
    assert dbm0_of_rms(float(np.sqrt(np.mean(milliwatt ** 2)))) == pytest.approx(0.0, abs=0.05)
    assert rms_of_dbm0(-19.0) == pytest.approx(10 ** ((-19 - 3.17) / 20) / np.sqrt(2))


def test_active_level_ignores_pauses():
    tone = _sine(-19.0)
    with_pauses = np.concatenate([tone, np.zeros(2 * RATE, np.float32), tone, np.zeros(RATE, np.float32)])
    assert active_speech_dbm0(tone, RATE) == pytest.approx(-19.0, abs=0.05)
    assert active_speech_dbm0(with_pauses, RATE) == pytest.approx(-19.0, abs=0.05)
    assert active_speech_dbm0(np.zeros(RATE, np.float32), RATE) is None
    assert gain_db_for(-13.0, -19.0) == -6.0 and gain_db_for(None, -19.0) == 0.0 and gain_db_for(-13.0, None) == 0.0


def test_the_limiter_keeps_a_full_scale_input_under_its_ceiling_with_any_gain():
    level = LineLevel(gain_db=12.0, rate=RATE)
    ceiling = peak_of_dbm0(0.0)
    square = np.sign(_sine(3.17, seconds=2.0, hz=300.0)).astype(np.float32)  # the loudest thing there is
    out = np.concatenate([level.apply(chunk) for chunk in np.array_split(square, 37)])
    assert np.max(np.abs(out)) <= ceiling
    assert np.max(np.abs(out)) > 0.99 * ceiling  # limited, not muted
    assert level.limited_samples > 0


def test_below_the_ceiling_the_gain_is_one_fixed_number_for_the_whole_stream():
    """No pumping: a loud passage, then a quiet one, in uneven chunks: every output sample is the input times
    the same gain (within float32 rounding)."""
    level = LineLevel(gain_db=-6.0, rate=RATE)
    audio = np.concatenate([_sine(-3.0, 0.5), _sine(-35.0, 1.0), np.zeros(RATE // 2, np.float32), _sine(-10.0, 0.5)])
    out = np.concatenate([level.apply(chunk) for chunk in np.array_split(audio, 23)])
    loud = np.abs(audio) > 1e-3
    assert np.allclose(out[loud] / audio[loud], 10 ** (-6 / 20), rtol=1e-5)
    assert level.limited_samples == 0


def test_after_a_peak_the_gain_returns_within_the_release_time():
    level = LineLevel(gain_db=0.0, rate=RATE)
    burst = np.concatenate([np.full(80, 0.99, np.float32), _sine(-20.0, 0.2)])
    out = level.apply(burst)
    tail = slice(80 + int(0.06 * RATE), None)  # 50 ms release, and some slack
    assert np.allclose(out[tail], burst[tail], rtol=1e-5)


def test_line_audio_without_a_level_leaves_the_engine_level():
    tone = (0.5 * np.sin(np.arange(24000) * 2 * np.pi * 440 / 24000)).astype(np.float32)
    line = LineAudio(24000, 8000, None)
    out = np.concatenate([line.push(tone), line.flush()])
    assert out.dtype == np.int16 and abs(out.size - 8000) <= 1
    assert np.max(np.abs(out)) == pytest.approx(0.5 * 32768, rel=0.02)
