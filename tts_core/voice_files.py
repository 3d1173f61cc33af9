"""The operator's voice files: enrolling a speaker from a prompt recording (`register_voice`, the
official zero-shot frontend run once), listing what the engine would load (`list_voices`) and removing
one (`remove_voice`). Behind `cosyvoice-gateway voice add|list|remove` (engines/cosyvoice2/voices.py).

The prompt is checked before any model runs (tts_core/features/prompt_audio.py, with the bounds in
tts_core/voices.py), an existing voice is overwritten only when asked, and a file the engine would
refuse is still listed (with the reason) and removable. Never imported by synthesis: enrolment needs
onnxruntime, which a running engine does not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from tts_core.voices import (FRAMES_PER_TOKEN, MAX_PROMPT_SECONDS, MIN_PROMPT_SECONDS, PROMPT_RATE, TOKEN_RATE,
                             Voice, raw_voice_files, voices_dir_of, write_raw, write_spk2info)

log = structlog.get_logger(__name__)


class VoiceExists(FileExistsError):
    """A voice of that name is already in the model directory."""


@dataclass(frozen=True)
class VoiceSummary:
    """One voice as `cosyvoice-gateway voice list` shows it."""

    name: str
    prompt_seconds: float
    transcript: str  # the prompt text decoded from its tokens (normalised, as the model reads it)
    path: Path  # the file it is loaded from
    problem: str = ""  # why the engine would refuse to start with it ("" when it loads)


def register_voice(model_dir: str | Path, name: str, wav_path: str | Path, transcript: str,
                   voices_dir: str | Path | None = None, replace: bool = False) -> Path:
    """Enrol `wav_path` (the speaker saying `transcript`) as voice `name`; returns the file written,
    `<voices_dir>/<name>.pt` (default voices_dir `<model_dir>/voices`). Everything about the input is
    checked before the ONNX models run; an existing voice is overwritten only with `replace`."""
    model_dir = Path(model_dir)
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise ValueError(f"voice name {name!r}: use letters, digits, '-' and '_' only")
    target_dir = voices_dir_of(model_dir, voices_dir)
    path = target_dir / f"{name}.pt"
    if not replace:
        for existing, entries in raw_voice_files(model_dir, target_dir):
            if existing == path or (isinstance(entries, Mapping) and name in entries):
                raise VoiceExists(f"voice {name!r} already exists ({existing})")
    voice = extract_voice(model_dir, name, Path(wav_path), transcript)
    write_spk2info(path, [voice])
    log.info("tts_voice_registered", voice=name, path=str(path), prompt_tokens=len(voice.flow_prompt_speech_token),
             prompt_text_tokens=len(voice.prompt_text), replaced=replace)
    return path


def list_voices(model_dir: str | Path, voices_dir: str | Path | None = None) -> list[VoiceSummary]:
    """Every voice the engine would load, in load order (a later file wins a name clash); a voice or
    file the engine would refuse is listed with the reason instead of stopping the listing."""
    from tts_core.model_dir import ModelDir

    model_dir = Path(model_dir)
    tokenizer = text_tokenizer(ModelDir.open(model_dir))
    summaries: dict[str, VoiceSummary] = {}
    for path, entries in raw_voice_files(model_dir, voices_dir_of(model_dir, voices_dir)):
        if isinstance(entries, str):
            summaries[path.stem] = VoiceSummary(path.stem, 0.0, "", path, entries)
            continue
        for name, entry in entries.items():
            try:
                voice = Voice.from_spk2info(str(name), entry, str(path))
            except ValueError as exc:
                summaries[str(name)] = VoiceSummary(str(name), 0.0, "", path, str(exc))
                continue
            summaries[voice.name] = VoiceSummary(voice.name, len(voice.flow_prompt_speech_token) / TOKEN_RATE,
                                                 tokenizer.decode(list(voice.prompt_text)), path)
    return list(summaries.values())


def remove_voice(model_dir: str | Path, name: str, voices_dir: str | Path | None = None) -> list[Path]:
    """Delete voice `name` from the voices directory, even from a file the engine would refuse;
    returns the files it was in. The model's own `spk2info.pt` is never edited (KeyError says so)."""
    model_dir = Path(model_dir)
    target_dir = voices_dir_of(model_dir, voices_dir)
    owners = []
    for path, entries in raw_voice_files(model_dir, target_dir):
        held = isinstance(entries, Mapping) and name in entries
        if path == model_dir / "spk2info.pt":
            if held:
                raise KeyError(f"voice {name!r} comes with the model ({path}); it is not removed")
        elif path == target_dir / f"{name}.pt" or held:
            owners.append(path)
            others = {k: v for k, v in entries.items() if k != name} if isinstance(entries, Mapping) else {}
            if others and path != target_dir / f"{name}.pt":
                write_raw(path, others)
            else:
                path.unlink()
    if not owners:
        raise KeyError(f"no voice {name!r} in {target_dir}")
    log.info("tts_voice_removed", voice=name, files=[str(p) for p in owners])
    return owners


def extract_voice(model_dir: Path, name: str, wav_path: Path, transcript: str) -> Voice:
    """The official zero-shot frontend (`frontend_zero_shot`) for one prompt: speech tokens and the
    CAM++ embedding from the 16 kHz wav, the prompt mel from that wav resampled to 24 kHz, both
    trimmed to 2 mel frames per token."""
    # Imported here: enrolment is an offline step, synthesis must not need onnxruntime.
    from tts_core.features.campplus_fbank import campplus_fbank
    from tts_core.features.prompt_audio import check_prompt_audio
    from tts_core.features.prompt_mel import PromptMelConfig, prompt_mel
    from tts_core.features.wav_file import resample
    from tts_core.features.whisper_logmel import whisper_logmel
    from tts_core.model_dir import ModelDir
    from tts_core.text.cosyvoice3 import zero_shot_prompt_text
    from tts_core.text.normalize import TextNormalizer

    if not transcript or not any(ch.isalnum() for ch in transcript):
        raise ValueError("the transcript is empty: give the words spoken in the prompt wav (--text)")
    md = ModelDir.open(model_dir)
    for path, what in ((md.campplus_path, "campplus.onnx"), (md.speech_tokenizer_path, md.family.speech_tokenizer_name)):
        if path is None:
            raise FileNotFoundError(f"{model_dir / what} is missing: voice enrolment needs it")
    wav16 = check_prompt_audio(wav_path, PROMPT_RATE, MIN_PROMPT_SECONDS, MAX_PROMPT_SECONDS).wav

    logmel = whisper_logmel(wav16, n_mels=128)
    tokens = _run_onnx(md.speech_tokenizer_path, [logmel.numpy(), np.array([logmel.shape[2]], dtype=np.int32)])
    tokens = tokens.reshape(-1).astype(np.int64)
    embedding = _run_onnx(md.campplus_path, [campplus_fbank(wav16)[None].numpy()]).reshape(-1)
    mel_config = PromptMelConfig.from_yaml(md.config)
    wav24 = resample(wav16.numpy(), PROMPT_RATE, mel_config.sample_rate)
    feat = prompt_mel(wav24, mel_config)
    # Official rule for 24 kHz models: exactly two mel frames per token, cut to the shorter of the two.
    n_tokens = min(feat.shape[0] // FRAMES_PER_TOKEN, len(tokens))
    if n_tokens == 0:
        raise ValueError(f"{wav_path}: the speech tokenizer found no speech tokens")
    tokenizer = text_tokenizer(md)
    if md.family.version == 3:
        # CosyVoice3's prompt prefix; the official frontend leaves a text holding <|...|> unnormalised.
        prompt_text = tokenizer.encode(zero_shot_prompt_text(transcript))
    else:
        prompt_text = tokenizer.encode(TextNormalizer(tokenizer).normalize(transcript))
    speech = tuple(int(t) for t in tokens[:n_tokens])
    emb = torch.from_numpy(embedding.astype(np.float32))
    return Voice(name=name, prompt_text=tuple(prompt_text), llm_prompt_speech_token=speech,
                 flow_prompt_speech_token=speech, prompt_speech_feat=feat[:FRAMES_PER_TOKEN * n_tokens].contiguous(),
                 llm_embedding=emb, flow_embedding=emb.clone())


def text_tokenizer(md):
    """The model directory's text tokenizer (CosyVoice3's has its special tokens), from a `ModelDir`."""
    from tts_core.text.cosyvoice3 import cosyvoice3_tokenizer
    from tts_core.text.tokenizer import TextTokenizer

    return cosyvoice3_tokenizer(md.qwen_dir) if md.family.version == 3 else TextTokenizer(md.qwen_dir)


def _run_onnx(path: Path, inputs: list[np.ndarray]) -> np.ndarray:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = 1  # an offline step; leave the cores to live calls
    session = onnxruntime.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise ValueError(f"{path}: expects {len(names)} inputs ({', '.join(names)}), not {len(inputs)}")
    return session.run(None, dict(zip(names, inputs)))[0]
