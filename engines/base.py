"""The streaming synthesis interface the gateway talks to, and the errors it understands.

An engine turns (text, voice, options) into a stream of float32 mono chunks at `sample_rate`
(24 kHz for every engine we ship), delivered asynchronously on the caller's event loop while the
synthesis itself runs on another thread. The gateway validates a request with `validate()` and opens its
stream before it answers a call, and waits for the stream's admission (`ChunkChannel.admitted`), so refusals
(unknown voice, bad text, no capacity) become SIP rejections, never mid-call silence.

An engine also reports its `health()`: whether it can take work now and how many slots it has free. The gateway
refuses calls (503) while an engine is down or full, and a watchdog restarts one whose worker died or hangs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal, get_args

from engines.channel import ChunkChannel
from engines.ssml.segments import Segment
from engines.text_check import text_problem

SAMPLE_RATE = 24_000
INSTRUCT_OPTIONS = ("instruct", "dialect")  # request options only a CosyVoice3 model takes


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


class BadText(SynthesisRefused):
    """Not UTF-8, control characters, or nothing speakable: the sender's fault, so a 400."""

    sip_status = 400
    sip_reason = "Bad Text"


class UnsupportedOption(BadText):
    """An instruct or dialect this engine's model does not take (any engine but a CosyVoice3 model), or a name
    outside the model's fixed list: the sender's fault, a 400 (over the worker link it travels as bad_text)."""

    sip_reason = "Bad TTS Option"


class NoCapacity(SynthesisRefused):
    """Every slot is taken (or the first audio would come too late): the PBX should route elsewhere."""

    sip_status = 503
    sip_reason = "Engine At Capacity"


class FirstAudioTooLate(NoCapacity):
    """Slots are free, but a stream opened now would start speaking later than the configured bound."""

    sip_reason = "Engine Busy"


class EngineUnavailable(SynthesisRefused):
    """The engine is warming up, restarting or dead: nothing can be spoken now."""

    sip_status = 503
    sip_reason = "Engine Unavailable"


class EngineSettingsError(ValueError):
    """A setting the engine refuses when it starts (a voice espeak-ng lacks, `device: cuda` on a host without
    one, a default voice the model has not): what only the engine can check. In-process (gateway/app.py) and
    in a worker (engine_service/__main__.py) it becomes one line naming the key and the value, exit 2."""

    def __init__(self, key: str, value: object, why: str) -> None:
        super().__init__(f"{key}: {value!r} {why}")
        self.key, self.value, self.why = key, value, why


class SynthesisFailed(Exception):
    """The engine broke while a stream was running; the call that owns the stream ends, no other."""


EngineState = Literal["ready", "warming", "down"]
# An engine that is ready on slower graphs while it compiles faster ones (cosyvoice2 with CUDA graphs):
# compiled: at full speed (also an engine with nothing to compile); compiling: serving, first chunks slower until
# the compiled graphs are in; failed: compiling them failed, serving on the slower graphs for good.
GraphsState = Literal["compiled", "compiling", "failed"]
GRAPHS_STATES: tuple[str, ...] = get_args(GraphsState)


@dataclass(frozen=True)
class EngineHealth:
    """What an engine can take now. `slots_free` None means the engine has no fixed slot count."""

    state: EngineState
    slots_total: int | None = None
    slots_free: int | None = None
    queue_depth: int = 0
    reason: str = ""
    graphs: GraphsState = "compiled"

    @property
    def accepting(self) -> bool:
        return self.state == "ready" and (self.slots_free is None or self.slots_free > 0)


@dataclass(frozen=True)
class SynthesisRequest:
    """`text` is what is said; an SSML request also carries its `segments` (speech and pauses, in order), and
    then `text` is their words, for validation and logs (engines/segmented.py builds both). `paced` False: the
    audio is collected whole before anyone hears it (a file, a cache prerender), so an engine that paces its
    work by a listener's playout (the CosyVoice runtime) renders it as fast as it can, behind live streams."""

    text: str
    voice: str
    call_id: str = ""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    segments: tuple[Segment, ...] = ()
    paced: bool = True


class SpeechEngine(ABC):
    """One backend. Implementations are thread-safe for `open_stream` from the event loop."""

    name: str = "abstract"
    streams_opened: int = 0  # engine streams opened since start: what the prompt cache saves shows here
    sample_rate: int = SAMPLE_RATE
    max_text_chars: int = 2000
    honours_rate: bool = False  # takes the request option `rate` (SSML prosody rate, 1.0 the voice's pace)
    # takes the request options `instruct` / `dialect` (CosyVoice3's fixed list; a worker link lets its worker say)
    takes_instructs: bool = False

    async def start(self) -> None:
        """Load models and warm up; must not block the event loop (run heavy work in a thread)."""

    async def close(self) -> None:
        """Release resources; streams still open end with SynthesisFailed."""

    async def prepare(self, texts: Sequence[str]) -> None:
        """Get ready to speak `texts` (the configured prompts) before a call asks for them, e.g. run a text
        frontend once, so the first caller of a prompt does not wait for it. Best effort; never on the event loop."""

    async def restart(self) -> None:
        """Bring a dead or stuck engine back; its open streams end with SynthesisFailed."""
        await self.close()
        await self.start()

    def health(self) -> EngineHealth:
        """Cheap, from the event loop: ready/warming/down and free slots. Down triggers the watchdog."""
        return EngineHealth("ready")

    def model_identity(self, voice: str) -> str:
        """What a cached prompt of `voice` depends on besides its text (speech_audio/prompt_store.py `PromptKey`):
        a new model, voice data or text frontend must give a new identity, so old audio is never played for it.
        Cheap: called for every call that may use the prompt cache."""
        return f"{self.name}:{voice}"

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
        if (problem := text_problem(request.text)) is not None:
            raise BadText(problem)
        if len(request.text) > self.max_text_chars:
            raise TextTooLong(f"text has {len(request.text)} characters, limit is {self.max_text_chars}")
        if request.voice not in self.voices():
            raise UnknownVoice(f"unknown voice {request.voice!r}; known: {', '.join(sorted(self.voices()))}")
        for key in INSTRUCT_OPTIONS:
            if request.options.get(key) is not None and not self.takes_instructs:
                raise UnsupportedOption(f"{key}: the {self.name} engine's model takes no instruct or dialect "
                                        "(a CosyVoice3 model does)")

    @abstractmethod
    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        """Start synthesis and return the stream of chunks. Call from the event loop thread.

        Raises `SynthesisRefused` when the request can be refused at once (validation, no capacity); an
        engine that learns of a refusal later (a worker process) delivers it through the channel's
        `admitted()` before any chunk. A request with `segments` is spoken through
        `engines.segmented.speak_segments` by in-process engines; a remote one sends the segments on."""
