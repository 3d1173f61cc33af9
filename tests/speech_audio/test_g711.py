"""G.711 must be byte-identical to the reference codec every phone and PBX implements (audioop's)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from speech_audio import g711

# The reference is never skipped: the stdlib's audioop up to Python 3.12, the `audioop-lts` backport (same C
# code, installed by the test extra) from 3.13 on, where the stdlib module is gone.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

ALL_INT16 = np.arange(65536, dtype=np.uint16).view(np.int16)


@pytest.mark.parametrize("codec, reference", [("PCMU", "lin2ulaw"), ("PCMA", "lin2alaw")])
def test_encode_matches_audioop_for_every_16_bit_sample(codec: str, reference: str) -> None:
    assert g711.encode(ALL_INT16, codec) == getattr(audioop, reference)(ALL_INT16.tobytes(), 2)


@pytest.mark.parametrize("codec, reference", [("PCMU", "ulaw2lin"), ("PCMA", "alaw2lin")])
def test_decode_matches_audioop_for_every_code(codec: str, reference: str) -> None:
    codes = bytes(range(256))
    assert g711.decode(codes, codec).tobytes() == getattr(audioop, reference)(codes, 2)


def test_known_codes_for_silence_and_full_scale() -> None:
    # The idle patterns telephony engineers recognise on the wire.
    assert g711.encode(np.zeros(2, np.int16), "PCMU") == b"\xff\xff"
    assert g711.encode(np.zeros(2, np.int16), "PCMA") == b"\xd5\xd5"
    assert g711.encode(np.array([32767, -32768], np.int16), "PCMU") == b"\x80\x00"


@pytest.mark.parametrize("codec", ["PCMU", "PCMA"])
def test_float_input_is_scaled_rounded_and_clipped(codec: str) -> None:
    floats = np.array([0.0, 0.5, -0.5, 1.5, -1.5, 0.25], dtype=np.float32)
    as_int = np.array([0, 16384, -16384, 32767, -32768, 8192], dtype=np.int16)
    assert g711.encode(floats, codec) == g711.encode(as_int, codec)


@pytest.mark.parametrize("codec", ["PCMU", "PCMA"])
def test_round_trip_error_is_within_g711_quantisation(codec: str) -> None:
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 8000)).astype(np.float32)
    decoded = g711.decode(g711.encode(tone, codec), codec).astype(np.float64) / 32768
    snr_db = 10 * np.log10(np.sum(tone.astype(np.float64) ** 2) / np.sum((decoded - tone) ** 2))
    assert snr_db > 30  # G.711 gives ~35-38 dB on a loud tone
