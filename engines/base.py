"""The streaming synthesis interface the gateway talks to, and the errors it understands.

An engine turns (text, voice, options) into a stream of float32 mono chunks at `sample_rate`
(24 kHz for every engine we ship), delivered asynchronously on the caller's event loop while the
synthesis itself runs on another thread. The gateway validates a request with `validate()` before it
answers a call, so refusals (unknown voice, empty text) become SIP rejections, never mid-call silence.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from engines.channel import ChunkChannel

SAMPLE_RATE = 24_000


class SynthesisRefused(Exception):
    """The request cannot be spoken; raised before any audio, with a reason a caller may see."""

    sip_status = 488
    sip_reason = "Not Acceptable Here"


class UnknownVoice(SynthesisRefused):
    sip_status = 404
    sip_reason = "Unknown Voice"


class EmptyText(SynthesisRefused):
    sip_status = 404
    sip_reason = "No Text To Speak"


class TextTooLong(SynthesisRefused):
    sip_status = 413
    sip_reason = "Text Too Long"


class SynthesisFailed(Exception):
    """The engine broke while a stream was running; the call that owns the stream ends, no other."""


@dataclass(frozen=True)
class SynthesisRequest:
    text: str
    voice: str
    call_id: str = ""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))


class SpeechEngine(ABC):
    """One backend. Implementations are thread-safe for `open_stream` from the event loop."""

    name: str = "abstract"
    sample_rate: int = SAMPLE_RATE
    max_text_chars: int = 2000

    async def start(self) -> None:
        """Load models and warm up; must not block the event loop (run heavy work in a thread)."""

    async def close(self) -> None:
        """Release resources; streams still open end with SynthesisFailed."""

    @abstractmethod
    def voices(self) -> Sequence[str]:
        """Names accepted as `SynthesisRequest.voice`."""

    @property
    @abstractmethod
    def default_voice(self) -> str: ...

    def validate(self, request: SynthesisRequest) -> None:
        """Raise a `SynthesisRefused` subclass naming the problem; cheap, no synthesis."""
        if not request.text or not request.text.strip():
            raise EmptyText("text is empty")
        if len(request.text) > self.max_text_chars:
            raise TextTooLong(f"text has {len(request.text)} characters, limit is {self.max_text_chars}")
        if request.voice not in self.voices():
            raise UnknownVoice(f"unknown voice {request.voice!r}; known: {', '.join(sorted(self.voices()))}")

    @abstractmethod
    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        """Start synthesis and return the stream of chunks. Call from the event loop thread."""
