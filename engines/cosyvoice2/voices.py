"""Enrolling a CosyVoice2 speaker (`cosyvoice-gateway voice add`): the gateway's CLI reaches tts_core's
voice registration only through here, so gateway/ never imports tts_core.

Enrolment is an offline step run once per voice: it needs the model's `campplus.onnx` and
`speech_tokenizer_v2.onnx` (onnxruntime, the `tts` extra), which synthesis never loads.
"""

from __future__ import annotations

from pathlib import Path


class EnrolmentUnavailable(RuntimeError):
    """This installation lacks what enrolment needs (tts_core or onnxruntime: pip install '.[tts]')."""


def add_voice(model_dir: str | Path, name: str, wav_path: str | Path, transcript: str) -> Path:
    """Register `wav_path` (3-10 s of the speaker saying `transcript`) as voice `name` in
    `<model_dir>/voices`; returns the file written. OSError/ValueError name what is wrong with the input."""
    try:
        from tts_core.voices import register_voice
    except ImportError as exc:
        raise EnrolmentUnavailable(str(exc)) from None
    return register_voice(model_dir, name, wav_path, transcript)
