"""Managing CosyVoice2 speakers (`cosyvoice-gateway voice add|list|remove`): the gateway's CLI reaches
tts_core's voice files only through here, so gateway/ never imports tts_core.

Enrolment is an offline step run once per voice: it needs the model's `campplus.onnx` and
`speech_tokenizer_v2.onnx` (onnxruntime, the `tts` extra), which synthesis never loads. A running
engine loads its voices at start, so a change here is used after the next start.
"""

from __future__ import annotations

from pathlib import Path


class EnrolmentUnavailable(RuntimeError):
    """This installation lacks what voice management needs (tts_core or onnxruntime: pip install '.[tts]')."""


def _tts_voices():
    try:
        import tts_core.voice_files
    except ImportError as exc:
        raise EnrolmentUnavailable(str(exc)) from None
    return tts_core.voice_files


def add_voice(model_dir: str | Path, name: str, wav_path: str | Path, transcript: str, replace: bool = False) -> Path:
    """Register `wav_path` (1-12 s of the speaker saying `transcript`) as voice `name` in
    `<model_dir>/voices`; returns the file written. FileExistsError when the voice exists and not
    `replace`; OSError/ValueError name what is wrong with the input."""
    voices = _tts_voices()
    try:
        return voices.register_voice(model_dir, name, wav_path, transcript, replace=replace)
    except ImportError as exc:  # onnxruntime, imported when the models run
        raise EnrolmentUnavailable(str(exc)) from None


def list_voices(model_dir: str | Path) -> list:
    """`tts_core.voice_files.VoiceSummary` for every voice the engine would load (name, prompt_seconds,
    transcript, path, problem)."""
    return _tts_voices().list_voices(model_dir)


def remove_voice(model_dir: str | Path, name: str) -> list[Path]:
    """Delete voice `name` from `<model_dir>/voices`; KeyError when there is none (or it ships with the model)."""
    return _tts_voices().remove_voice(model_dir, name)
