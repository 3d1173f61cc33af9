"""Formats and rates: what a request may ask for, and the bytes the encoder makes of engine chunks."""

from __future__ import annotations

import io
import shutil
import subprocess
import wave

import numpy as np
import pytest

from engine_service.api.audio_format import AudioEncoder, AudioFormat, FormatProblem


def encode_all(audio_format: AudioFormat, chunks: list[np.ndarray]) -> bytes:
    encoder = AudioEncoder(audio_format, 24000)
    return b"".join(encoder.encode(chunk) for chunk in chunks) + encoder.finish()


@pytest.mark.parametrize("rate", [8000, 16000, 24000])
def test_streamed_pcm_has_the_rate_s_length_and_keeps_a_tone(rate):
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)).astype(np.float32)
    data = encode_all(AudioFormat("pcm_s16le", rate), np.array_split(tone, 7))
    samples = np.frombuffer(data, dtype="<i2")
    assert abs(len(samples) - rate) <= 2  # one second at the asked rate
    spectrum = np.abs(np.fft.rfft(samples[rate // 10: -rate // 10]))
    peak_hz = np.argmax(spectrum) * rate / (len(samples) - 2 * (rate // 10))
    assert abs(peak_hz - 440) < 5


def test_wav_stream_starts_with_a_header_python_can_read():
    data = encode_all(AudioFormat("wav", 16000), [np.zeros(2400, dtype=np.float32)])
    with wave.open(io.BytesIO(data)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (16000, 1, 2)
        assert len(reader.readframes(10**6)) == 1600 * 2


@pytest.mark.parametrize("reader", ["sox", "ffmpeg"])
def test_a_streamed_wav_read_from_a_pipe_by_sox_and_ffmpeg_is_all_the_audio(reader):
    """The header's sizes are 0xFFFFFFFF, what ffmpeg itself writes to a pipe: readers go to the end of the
    stream (a size of 0, the other convention, makes sox read nothing and Python's wave refuse the file)."""
    if shutil.which(reader) is None:
        pytest.skip(f"{reader} not installed")
    tone = (0.5 * np.sin(2 * np.pi * 440 * np.arange(24000) / 24000)).astype(np.float32)
    data = encode_all(AudioFormat("wav", 16000), np.array_split(tone, 5))
    assert data[4:8] == data[40:44] == b"\xff\xff\xff\xff"
    command = {"sox": ["sox", "-t", "wav", "-", "-t", "raw", "-"],
               "ffmpeg": ["ffmpeg", "-v", "error", "-f", "wav", "-i", "pipe:0", "-f", "s16le", "pipe:1"]}[reader]
    done = subprocess.run(command, input=data, capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == data[44:]


def test_g711_is_one_byte_per_sample_at_8k():
    data = encode_all(AudioFormat("pcmu", 8000), [np.zeros(2400, dtype=np.float32)])
    assert data == b"\xff" * 800


@pytest.mark.parametrize(("name", "rate", "field"), [
    ("mp3", None, "format"), ("pcmu", 16000, "sample_rate"), ("wav", 44100, "sample_rate"),
    ("wav", "16000", "sample_rate"), ("wav", True, "sample_rate"),
])
def test_impossible_requests_name_their_field(name, rate, field):
    with pytest.raises(FormatProblem) as caught:
        AudioFormat.parse(name, rate)
    assert caught.value.field == field


def test_defaults_and_content_types():
    assert AudioFormat.parse(None, None) == AudioFormat("wav", 24000)
    assert AudioFormat.parse("pcma", None).content_type == "audio/PCMA;rate=8000"
    assert AudioFormat.parse("pcm_s16le", 8000).content_type == "audio/l16;rate=8000"
