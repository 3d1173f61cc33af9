"""G.722 through the G722 package, byte for byte against FFmpeg's encoder and decoder (an independent
implementation): shipped vectors always, and a fresh signal when ffmpeg is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from gateway.media.codecs import CODECS, frame_encoder
from gateway.media.g722 import G722Decoder, G722Encoder

DATA = Path(__file__).parents[2] / "data" / "g722"


def encode_in_frames(pcm: np.ndarray) -> bytes:
    """As a call sends it: one encoder, a 20 ms frame (320 samples) per packet."""
    encode = frame_encoder("G722")
    packets = [encode(pcm[i:i + 320]) for i in range(0, len(pcm), 320)]
    assert {len(p) for p in packets} == {160}  # 64 kbit/s: 160 bytes per 20 ms
    return b"".join(packets)


def test_encoder_matches_ffmpeg_byte_for_byte_across_packets():
    pcm = np.fromfile(DATA / "chirp_noise_16k.s16le", dtype="<i2")
    assert encode_in_frames(pcm) == (DATA / "chirp_noise_16k.ffmpeg.g722").read_bytes()


def test_decoder_matches_ffmpeg_sample_for_sample():
    payload = (DATA / "chirp_noise_16k.ffmpeg.g722").read_bytes()
    decoder = G722Decoder()
    pcm = np.concatenate([decoder.decode(payload[i:i + 160]) for i in range(0, len(payload), 160)])
    assert np.array_equal(pcm, np.fromfile(DATA / "chirp_noise_16k.ffmpeg_decoded.s16le", dtype="<i2"))


def test_each_call_has_its_own_encoder_state():
    """ADPCM: the same frame encodes differently after different history, so encoders are never shared."""
    frame = (np.sin(np.arange(320) / 3) * 9000).astype(np.int16)
    first = G722Encoder()
    warmed = first.encode(frame) and first.encode(frame)
    assert G722Encoder().encode(frame) != warmed
    assert frame_encoder("G722") is not frame_encoder("G722")


def test_g722_packets_carry_320_samples_on_the_8000_hz_rtp_clock():
    codec = CODECS["G722"]
    assert (codec.payload_type, codec.audio_rate, codec.frame_samples) == (9, 16000, 320)
    assert CODECS["PCMU"].frame_samples == 160


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg not installed")
def test_a_fresh_signal_matches_ffmpeg(tmp_path):
    rng = np.random.default_rng()
    t = np.arange(16000 * 2) / 16000
    pcm = np.clip(0.3 * np.sin(2 * np.pi * rng.uniform(100, 7000) * t) + 0.2 * rng.standard_normal(t.size),
                  -1, 1)
    pcm = np.round(pcm * 32767).astype("<i2")
    pcm.tofile(tmp_path / "in.raw")
    subprocess.run(["ffmpeg", "-loglevel", "error", "-f", "s16le", "-ar", "16000", "-ac", "1", "-i",
                    str(tmp_path / "in.raw"), "-c:a", "g722", "-f", "g722", str(tmp_path / "out.g722")], check=True)
    assert encode_in_frames(pcm) == (tmp_path / "out.g722").read_bytes()
