"""What a SPEAK body asks to be said (RFC 6787 §8.7): text/plain as it is, SSML through the one SSML module
every way in uses (engines.ssml, through engines.segmented.speech_request: breaks as silence, say-as, sub,
prosody; a DOCTYPE or entity is refused, never expanded). This module only picks the content type and reads
the body as UTF-8. No sockets, no clocks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engines.base import SynthesisRequest
from engines.segmented import speech_request
from engines.ssml import SsmlError

TEXT_TYPES = ("text/plain",)
SSML_TYPES = ("application/ssml+xml", "application/synthesis+ssml")  # the second: MRCPv1 / UniMRCP's umc
URI_LIST = "text/uri-list"


class SpeechTextError(ValueError):
    """The body cannot be read as speech (Completion-Cause 002 parse-failure)."""


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def speak_request(content_type: str, body: bytes, voice: str, *, call_id: str = "",
                  options: Mapping[str, Any] | None = None) -> SynthesisRequest:
    """The engine request for a SPEAK body; `content_type` is one of TEXT_TYPES or SSML_TYPES (lower-case, no
    parameters). Raises SpeechTextError for a body that is not UTF-8 or SSML that cannot be spoken."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpeechTextError(f"body is not UTF-8 (byte {exc.start})") from None
    try:
        return speech_request(text.strip(), voice, call_id=call_id, options=options, ssml=content_type in SSML_TYPES)
    except SsmlError as exc:
        raise SpeechTextError(str(exc)) from None
