"""Golden parity: prompt-audio features against the official frontend (Matcha mel, Kaldi fbank,
Whisper log-mel), plus the wav reader. Sizes come from the golden files."""

from __future__ import annotations

import math
import struct
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.features import (PromptMelConfig, WavFormatError, campplus_fbank, load_wav, prompt_mel, read_wav,
                               resample, whisper_logmel)
from tts_core.model_config import load_model_yaml


@pytest.fixture(scope="module")
def golden(golden_dir: Path) -> dict:
    return torch.load(golden_dir / "cases" / "frontend.pt", weights_only=False)


def test_prompt_mel_golden_parity(golden: dict, tiny_model_dir: Path) -> None:
    # The golden prompt_mel was made with fmax = Nyquist (golden README), which is the yaml's
    # `mel_spec_transform1` entry; the official frontend itself uses `feat_extractor` (fmax 8000).
    config = PromptMelConfig.from_yaml(load_model_yaml(tiny_model_dir / "cosyvoice2.yaml"), "mel_spec_transform1")
    mel = prompt_mel(golden["wav24"], config)
    assert mel.shape == golden["prompt_mel"].shape
    assert mel.shape[0] == golden["wav24"].shape[-1] // config.hop  # one frame per hop, uncentred
    # Natural-log mel of a 1920-point float32 STFT: ~5e-6 observed.
    assert float((mel - golden["prompt_mel"]).abs().max()) <= 1e-4


def test_whisper_logmel_golden_parity(golden: dict) -> None:
    expected = golden["whisper_logmel128"]
    feat = whisper_logmel(golden["wav16"], n_mels=expected.shape[1])
    assert feat.shape == expected.shape
    # log10 of a float32 power spectrum, then /4: ~2e-5 observed.
    assert float((feat - expected).abs().max()) <= 1e-4


def test_campplus_fbank_golden_parity(golden: dict) -> None:
    expected = golden["campplus_fbank"]
    feat = campplus_fbank(golden["wav16"])
    assert feat.shape == expected.shape
    err = (feat - expected).abs()
    # Why not 1e-4 everywhere: Kaldi's pre-emphasis (x[n] - 0.97 x[n-1]) cancels low frequencies by
    # ~30x before the FFT, so the lowest, narrowest mel bins carry a float32 relative error of a few
    # 1e-4 in *both* implementations: the official (torchaudio, float32) values themselves differ by
    # up to 4e-4 from a float64 evaluation of the same formula on this prompt, and ours by 3e-4. The
    # max is bounded at that float32 noise level (x2.5), while the bulk must agree far tighter; a
    # wrong window, pre-emphasis, mel scale or mean removal is off by >1e-2 nearly everywhere.
    assert float(err.max()) <= 1e-3
    assert float(err.flatten().quantile(0.99)) <= 1e-4
    assert float(err.mean()) <= 2e-5
    # Mean-normalised over time, as fed to campplus.onnx.
    assert float(feat.mean(dim=0).abs().max()) <= 1e-5


def test_features_accept_numpy_and_batched_tensors(golden: dict) -> None:
    wav = golden["wav16"]
    assert torch.equal(whisper_logmel(wav[0].numpy()), whisper_logmel(wav))
    assert torch.equal(campplus_fbank(wav[0]), campplus_fbank(wav))
    with pytest.raises(ValueError, match="mono"):
        campplus_fbank(torch.zeros(2, 16000))


def test_read_float_wav_golden(golden_dir: Path, golden: dict) -> None:
    for name, key, rate in [("prompt_16k.wav", "wav16", 16000), ("prompt_24k.wav", "wav24", 24000)]:
        audio = read_wav(golden_dir / "cases" / name)
        assert audio.sample_rate == rate
        assert torch.equal(torch.from_numpy(audio.samples[:, 0]), golden[key][0])
        assert torch.equal(load_wav(golden_dir / "cases" / name, rate), golden[key][0])


def _tone(rate: int, seconds: float, hz: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * math.pi * hz * t)).astype(np.float32)


def test_read_pcm16_stereo_wav_mixes_down(tmp_path: Path) -> None:
    left, right = _tone(16000, 0.1, 440), _tone(16000, 0.1, 880)
    pcm = np.round(np.stack([left, right], axis=1) * 32767).astype("<i2")
    path = tmp_path / "stereo.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(2)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    wav = load_wav(path, 16000)
    assert wav.shape == (left.shape[0],)
    assert float(np.abs(wav.numpy() - (left + right) / 2).max()) <= 2 / 32768  # 16-bit quantisation


def test_read_pcm24_wav(tmp_path: Path) -> None:
    tone = _tone(24000, 0.05, 300)
    ints = np.round(tone * (2 ** 23 - 1)).astype(np.int32)
    raw = np.stack([ints & 0xFF, (ints >> 8) & 0xFF, (ints >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    fmt = struct.pack("<HHIIHH", 1, 1, 24000, 24000 * 3, 3, 24)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(raw)) + raw
    path = tmp_path / "pcm24.wav"
    path.write_bytes(b"RIFF" + struct.pack("<I", len(body)) + body)
    audio = read_wav(path)
    assert audio.sample_rate == 24000
    assert float(np.abs(audio.samples[:, 0] - tone).max()) <= 1 / 2 ** 22


def test_read_wav_rejects_non_wav(tmp_path: Path) -> None:
    path = tmp_path / "not.wav"
    path.write_bytes(b"ID3\x03" + b"\x00" * 64)
    with pytest.raises(WavFormatError):
        read_wav(path)


def test_resample_keeps_pitch_and_level() -> None:
    tone = _tone(16000, 1.0, 1000)
    out = resample(tone, 16000, 24000)
    assert out.shape == (24000,)
    spectrum = np.abs(np.fft.rfft(out[2400:-2400] * np.hanning(out.shape[0] - 4800)))
    peak_hz = np.argmax(spectrum) * 24000 / (out.shape[0] - 4800)
    assert abs(peak_hz - 1000) < 2
    assert abs(float(np.abs(out[2400:-2400]).max()) - 0.5) < 0.01
