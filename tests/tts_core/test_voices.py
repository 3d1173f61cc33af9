"""Voices: the official spk2info loads; enrolment from a wav runs the ONNX frontend once and the
resulting voice synthesises. The ONNX models are stand-ins with the real I/O signatures
(tests/tts_core/onnx_standins.py), written into a copy of the tiny model dir."""

from __future__ import annotations

import shutil
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tts_core.onnx_standins import write_campplus_standin, write_speech_tokenizer_standin
from tts_core.runtime import CollectingSink, CosyVoice2Pipeline, JobOptions
from tts_core.voices import Voice, VoiceBank, read_spk2info, register_voice


@pytest.fixture()
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "model"
    shutil.copytree(tiny_model_dir, target)
    write_campplus_standin(target / "campplus.onnx")
    write_speech_tokenizer_standin(target / "speech_tokenizer_v2.onnx")
    return target


def test_official_spk2info_loads(tiny_model_dir: Path) -> None:
    bank = VoiceBank.load(tiny_model_dir)
    voice = bank.get("golden_speaker")
    raw = torch.load(tiny_model_dir / "spk2info.pt", weights_only=False)["golden_speaker"]
    assert voice.prompt_speech_feat.shape == (100, 80) and voice.flow_embedding.shape == (192,)
    assert list(voice.flow_prompt_speech_token) == raw["flow_prompt_speech_token"][0].tolist()
    # Round trip through the official format keeps every field and its dtype.
    again = voice.to_spk2info()
    for key, value in raw.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key


def test_register_voice_then_synthesize(model_copy: Path, golden_dir: Path) -> None:
    torch.set_num_threads(1)
    path = register_voice(model_copy, "alice", golden_dir / "cases" / "prompt_16k.wav", "Hello, this is Alice.")
    assert path == model_copy / "voices" / "alice.pt"
    (voice,) = read_spk2info(path)
    frontend = torch.load(golden_dir / "cases" / "frontend.pt", weights_only=False)
    # 3 s at 25 Hz -> 75 tokens; the mel is cut to exactly two frames per token.
    assert len(voice.flow_prompt_speech_token) == 75
    assert voice.llm_prompt_speech_token == voice.flow_prompt_speech_token
    assert voice.prompt_speech_feat.shape == (150, 80)
    assert len(voice.prompt_text) > 0 and voice.flow_embedding.shape == (192,)
    assert torch.isfinite(voice.prompt_speech_feat).all()
    # The stored mel follows the prompt in time like the golden 24 kHz prompt mel does. (Not equal:
    # the official frontend resamples the 16 kHz wav and uses fmax 8000; the golden mel is of the
    # 24 kHz file at fmax Nyquist.) Frame by frame, loudness and the chirp's pitch track match.
    ours, golden = voice.prompt_speech_feat, frontend["prompt_mel"]
    loudness = np.corrcoef(ours.exp().sum(1).log(), golden.exp().sum(1).log())[0, 1]
    assert loudness > 0.9
    assert np.corrcoef(ours.argmax(1), golden.argmax(1))[0, 1] > 0.9

    pipeline = CosyVoice2Pipeline.load(model_copy, max_batch=1, max_len=512)
    try:
        assert "alice" in pipeline.voices and "golden_speaker" in pipeline.voices
        sink = CollectingSink()
        pipeline.synthesize("Hi.", "alice", sink, JobOptions(seed=3, min_tokens=40, max_tokens=40))
        audio = np.concatenate(sink.wait(60))
    finally:
        pipeline.close()
    assert len(audio) == 40 * 960 and np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_register_voice_errors_name_the_problem(model_copy: Path, golden_dir: Path, tmp_path: Path) -> None:
    wav = golden_dir / "cases" / "prompt_16k.wav"
    long_wav = tmp_path / "long.wav"
    with wave.open(str(long_wav), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
        w.writeframes(np.zeros(16000 * 31, np.int16).tobytes())
    with pytest.raises(ValueError, match="31.0 s"):
        register_voice(model_copy, "long", long_wav, "words")
    not_wav = tmp_path / "notes.txt"
    not_wav.write_text("hello")
    with pytest.raises(ValueError, match="not a RIFF/WAVE"):
        register_voice(model_copy, "text", not_wav, "words")
    (model_copy / "campplus.onnx").unlink()
    with pytest.raises(FileNotFoundError, match="campplus.onnx"):
        register_voice(model_copy, "bob", wav, "words")


def test_bad_voice_file_is_refused_at_load(tiny_model_dir: Path, tmp_path: Path) -> None:
    good = VoiceBank.load(tiny_model_dir).get("golden_speaker")
    entry = good.to_spk2info()
    entry["prompt_speech_feat"] = entry["prompt_speech_feat"][:, :, :40]
    (tmp_path / "bad.pt").parent.mkdir(exist_ok=True)
    torch.save({"bad": entry}, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="bad.pt.*prompt_speech_feat"):
        VoiceBank.load(tiny_model_dir, tmp_path)
    assert isinstance(good, Voice)
