"""Voices: the official spk2info loads; enrolment from a wav runs the ONNX frontend once and the
resulting voice synthesises. The ONNX models are stand-ins with the real I/O signatures
(tests/tts_core/onnx_standins.py), written into a copy of the tiny model dir."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tts_core.onnx_standins import model_dir_for_enrolment
from tts_core.runtime import CollectingSink, CosyVoice2Pipeline, JobOptions
from tts_core.voice_files import VoiceExists, list_voices, register_voice, remove_voice
from tts_core.voices import MAX_PROMPT_TOKENS, Voice, VoiceBank, read_spk2info


@pytest.fixture()
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return model_dir_for_enrolment(tiny_model_dir, tmp_path / "model")


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

    assert_speaks(model_copy, "alice", also="golden_speaker")


def assert_speaks(model_dir: Path, voice: str, also: str | None = None) -> None:
    """The model directory loads with `voice` (and `also`) and speaks 40 forced tokens of audible audio in it."""
    pipeline = CosyVoice2Pipeline.load(model_dir, max_batch=1, max_len=512)
    try:
        assert voice in pipeline.voices and (also is None or also in pipeline.voices)
        sink = CollectingSink()
        pipeline.synthesize("Hi.", voice, sink, JobOptions(seed=3, min_tokens=40, max_tokens=40))
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


def write_wav(path: Path, samples: np.ndarray, rate: int = 16000) -> Path:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1), w.setsampwidth(2), w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype(np.int16).tobytes())
    return path


def speechlike(seconds: float, rate: int = 16000, level: float = 0.1) -> np.ndarray:
    """Noise under a 4 Hz syllable envelope: loud enough, never at full scale."""
    t = np.arange(int(seconds * rate)) / rate
    noise = np.random.default_rng(0).standard_normal(t.size)
    return level * noise * (0.6 + 0.4 * np.sin(2 * np.pi * 4 * t)) / 3


@pytest.mark.parametrize(("samples", "rate", "transcript", "reason"), [
    (speechlike(20), 16000, "words", "prompt is 20.0 s; give 1-12 s"),
    (speechlike(0.6), 16000, "words", "prompt is 0.6 s; give 1-12 s"),
    (speechlike(4, 8000), 8000, "words", "recorded at 8000 Hz; the model needs at least 16000 Hz"),
    (np.zeros(16000 * 4), 16000, "words", "nearly silent"),
    (speechlike(4, level=1.0) * 40, 16000, "words", "clipped"),
    (speechlike(4), 16000, "  ", "transcript is empty"),
    (speechlike(4), 16000, "...", "transcript is empty"),
], ids=["too-long", "too-short", "8kHz", "silent", "clipped", "blank-text", "no-words"])
def test_register_voice_refuses_a_prompt_the_model_cannot_use(model_copy: Path, tmp_path: Path, samples, rate,
                                                              transcript, reason) -> None:
    wav = write_wav(tmp_path / "prompt.wav", samples, rate)
    with pytest.raises(ValueError, match=reason.replace(".", r"\.")):
        register_voice(model_copy, "carol", wav, transcript)
    assert not (model_copy / "voices").exists()


def test_register_voice_never_overwrites_without_replace(model_copy: Path, golden_dir: Path) -> None:
    torch.set_num_threads(1)
    wav = golden_dir / "cases" / "prompt_16k.wav"
    path = register_voice(model_copy, "alice", wav, "Hello, this is Alice.")
    before = path.read_bytes()
    with pytest.raises(VoiceExists, match=f"voice 'alice' already exists \\({path}\\)"):
        register_voice(model_copy, "alice", wav, "Something else.")
    assert path.read_bytes() == before
    with pytest.raises(VoiceExists, match="golden_speaker"):  # a voice the model ships counts too
        register_voice(model_copy, "golden_speaker", wav, "words")
    register_voice(model_copy, "alice", wav, "Something else.", replace=True)
    (alice,) = [v for v in list_voices(model_copy) if v.name == "alice"]
    assert alice.transcript == "Something else." and alice.prompt_seconds == 3.0 and not alice.problem
    assert remove_voice(model_copy, "alice") == [path] and not path.exists()
    with pytest.raises(KeyError, match="comes with the model"):
        remove_voice(model_copy, "golden_speaker")
    with pytest.raises(KeyError, match="no voice 'alice'"):
        remove_voice(model_copy, "alice")


def stretched(voice: Voice, tokens: int, name: str) -> dict:
    """`voice`'s entry with its prompt repeated to `tokens` speech tokens (a longer prompt)."""
    entry = voice.to_spk2info()
    reps = -(-tokens // len(voice.flow_prompt_speech_token))
    for key in ("llm_prompt_speech_token", "flow_prompt_speech_token"):
        entry[key] = entry[key].repeat(1, reps)[:, :tokens]
        entry[key + "_len"] = torch.tensor([tokens], dtype=torch.int32)
    entry["prompt_speech_feat"] = entry["prompt_speech_feat"].repeat(1, reps, 1)[:, :2 * tokens]
    entry["prompt_speech_feat_len"] = torch.tensor([2 * tokens], dtype=torch.int32)
    return {name: entry}


def test_a_start_with_a_broken_voice_file_names_the_voice_and_the_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    good = VoiceBank.load(tiny_model_dir).get("golden_speaker")
    voices = tmp_path / "voices"
    voices.mkdir()
    torch.save(stretched(good, 500, "long"), voices / "long.pt")  # 20 s: what an unchecked `voice add` wrote
    with pytest.raises(ValueError, match=r"long\.pt: voice 'long': its prompt is 20\.0 s; at most 12 s fits"):
        VoiceBank.load(tiny_model_dir, voices)
    (voices / "long.pt").write_bytes(b"\x80\x04truncated")
    with pytest.raises(ValueError, match=r"long\.pt: not a readable speaker file"):
        VoiceBank.load(tiny_model_dir, voices)
    (broken,) = [v for v in list_voices(tiny_model_dir, voices) if v.name == "long"]
    assert "not a readable speaker file" in broken.problem
    assert remove_voice(tiny_model_dir, "long", voices) == [voices / "long.pt"]  # removable though unreadable


def test_the_longest_prompt_add_accepts_fits_the_engine(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The 12 s bound is the flow pool's room per voice: a voice at the bound starts the engine."""
    torch.set_num_threads(1)
    good = VoiceBank.load(tiny_model_dir).get("golden_speaker")
    voices = tmp_path / "voices"
    voices.mkdir()
    torch.save(stretched(good, MAX_PROMPT_TOKENS, "longest"), voices / "longest.pt")
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, voices_dir=voices, max_batch=1, max_len=1024)
    try:
        assert pipeline.voices.get("longest").prompt_speech_feat.shape == (2 * MAX_PROMPT_TOKENS, 80)
        sink = CollectingSink()
        pipeline.synthesize("Hi.", "longest", sink, JobOptions(seed=3, min_tokens=10, max_tokens=10))
        assert len(np.concatenate(sink.wait(60))) == 10 * 960
    finally:
        pipeline.close()


def test_a_cosyvoice3_voice_carries_the_prompt_prefix_and_synthesises(tiny3_model_dir: Path, golden3_dir: Path,
                                                                       tmp_path: Path) -> None:
    """`voice add` on a CosyVoice3 directory: its speech tokenizer (v3) runs, the prompt text is the
    system prefix + the transcript (as the official zero-shot frontend builds it), and the voice speaks."""
    torch.set_num_threads(1)
    model = model_dir_for_enrolment(tiny3_model_dir, tmp_path / "model")
    path = register_voice(model, "mei", golden3_dir / "cases" / "prompt_24k.wav", "您好，欢迎致电。")
    (voice,) = read_spk2info(path)
    assert len(voice.flow_prompt_speech_token) == 50 and voice.prompt_speech_feat.shape == (100, 80)
    # The golden speaker's prompt text is the official tokens of that prefix + this transcript.
    assert voice.prompt_text == VoiceBank.load(tiny3_model_dir).get("golden_speaker").prompt_text
    (summary,) = [v for v in list_voices(model) if v.name == "mei"]
    assert summary.transcript == "You are a helpful assistant.您好，欢迎致电。"  # special tokens not shown
    assert_speaks(model, "mei")
