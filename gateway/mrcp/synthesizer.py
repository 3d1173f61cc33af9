"""One speechsynth channel's state machine (RFC 6787 §8): IDLE, SPEAKING, PAUSED, and its queue of SPEAKs.

Requests come in one at a time from the control connection (`handle`); every answer goes out through
`send`, the connection the channel's last request came on. A SPEAK is checked whole before it is taken
(headers §8.4, body §8.7, then the engine's own text and voice checks: a refusal is the SPEAK's `407
COMPLETE` with a Completion-Cause, never the session's end). Taken, it either speaks now (`200
IN-PROGRESS` once the engine admitted its stream) or waits behind the one speaking (`200 PENDING`); each
ends with SPEAK-COMPLETE (§8.4.3: 000 normal, 002 parse-failure, 004 error). STOP and BARGE-IN-OCCURRED
end the speaking SPEAK and the queued ones with no SPEAK-COMPLETE, naming them in Active-Request-Id-List
(§8.8, §8.11); PAUSE and RESUME hold and release the channel's packets (§8.9, §8.10).

Speech comes from the gateway's `CallSpeech` as a SIP call's does (the voice's fixed gain to the configured line
level under the limiter, a voice never measured measured on its first stream), at the codec's rate, uncached (a
SPEAK is one client's text); it goes through the session's `CallMedia` (the same playout buffer and packet clock
as a SIP call). A STOP takes the channel off the clock before its response is written, so no packet follows it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from engines.base import BadText, EmptyText, SynthesisFailed, SynthesisRefused, SynthesisRequest
from gateway import metrics
from gateway.media.call_media import CallMedia
from gateway.mrcp import params
from gateway.mrcp.message import (
    MANDATORY_HEADER_MISSING,
    METHOD_FAILED,
    METHOD_NOT_ALLOWED,
    METHOD_NOT_VALID_IN_STATE,
    OUT_OF_ORDER,
    SUCCESS,
    SUCCESS_WITH_IGNORE,
    UNSUPPORTED_HEADER_VALUE,
    MessageError,
    MrcpEvent,
    MrcpRequest,
    MrcpResponse,
)
from gateway.mrcp.speech_text import SSML_TYPES, TEXT_TYPES, URI_LIST, SpeechTextError, media_type, speak_request
from gateway.speech import CallSpeech, Speech

log = structlog.get_logger(__name__)

# §8.4.3 Completion-Cause values of the synthesizer
NORMAL, PARSE_FAILURE, URI_FAILURE, ERROR, LANGUAGE_UNSUPPORTED = (
    "000 normal", "002 parse-failure", "003 uri-failure", "004 error", "005 language-unsupported")
_NTP_EPOCH_OFFSET = 2208988800  # seconds from 1900 to 1970 (RFC 5905)
MAX_QUEUED = 32  # SPEAKs waiting behind the one speaking; more are refused (004), so a client cannot hoard memory


class SpeakRefused(Exception):
    """A SPEAK that will not be spoken: its 407 response carries `cause` and `reason`."""

    def __init__(self, cause: str, reason: str) -> None:
        super().__init__(reason)
        self.cause = cause
        self.reason = reason


@dataclass
class _Speak:
    request_id: int
    synthesis: SynthesisRequest
    kill_on_barge_in: bool
    task: asyncio.Task[None] | None = None
    playing: bool = False  # its engine stream is admitted and its audio on the way (PAUSE acts on it)


class Synthesizer:
    def __init__(self, channel: str, call_id: str, speech: CallSpeech, media: CallMedia,
                 voice_aliases: Mapping[str, str]) -> None:
        self.channel = channel
        self._call_id = call_id
        self._speech = speech
        self._engine = speech.engine
        self._media = media
        self._aliases = voice_aliases
        self._params: dict[str, str] = {}
        self._speaking: _Speak | None = None
        self._paused = False
        self._queue: deque[_Speak] = deque()
        self._last_request_id = -1
        self._last_marker: str | None = None
        self._send: Callable[[bytes], None] = lambda data: None
        self._connection: object | None = None  # the connection the last request came on
        # Set while that connection is open / once it closed: the session ends a channel left without one.
        self.attached, self.detached = asyncio.Event(), asyncio.Event()
        self._log = log.bind(call_id=call_id[:64], channel=channel)

    # -- requests ----------------------------------------------------------------------------------
    def handle(self, request: MrcpRequest, send: Callable[[bytes], None], connection: object) -> None:
        """Answer one request of this channel; `send` writes to `connection`, the one it came on."""
        self._send, self._connection = send, connection
        self.attached.set()
        self.detached.clear()
        metrics.mrcp_requests_total.labels(method=metrics.mrcp_method_label(request.method)).inc()
        try:
            if request.request_id <= self._last_request_id:
                raise MessageError(OUT_OF_ORDER, f"request-id {request.request_id} is not above "
                                                 f"{self._last_request_id} (§5.1)", request.request_id, 0)
            self._last_request_id = request.request_id
            handler = _HANDLERS.get(request.method)
            if handler is None:
                raise MessageError(METHOD_NOT_ALLOWED, f"method {request.method[:20]!r} is not served by this "
                                                       "synthesizer (no lexicons, no recognizer)", request.request_id, 0)
            params.check_names(request.request_id, request.headers)
            handler(self, request)
        except MessageError as exc:
            self._log.info("mrcp_request_refused", method=request.method[:20], status=exc.status, reason=exc.reason)
            self._respond(request, exc.status)

    def _set_params(self, request: MrcpRequest) -> None:
        values = params.settable_values(request.request_id, request.headers)
        self._params.update(values)
        ignored = params.ignored_names(request.headers)
        self._log.info("mrcp_set_params", values=values, ignored=ignored)
        self._respond(request, SUCCESS_WITH_IGNORE if ignored else SUCCESS)

    def _get_params(self, request: MrcpRequest) -> None:
        asked = [params.canonical(name) for name in request.headers.names()]
        names = [name for name in asked if name is not None] or [*params.SETTABLE, *params.READ_ONLY]
        values = {**self._params, "Speech-Marker": self._last_marker} if self._last_marker else self._params
        self._respond(request, SUCCESS, headers=tuple((name, values[name]) for name in names if name in values))

    def _speak(self, request: MrcpRequest) -> None:
        try:
            speak = self._checked_speak(request)
        except SpeakRefused as exc:
            self._log.info("mrcp_speak_refused", request_id=request.request_id, cause=exc.cause, reason=exc.reason)
            metrics.mrcp_speaks_total.labels(cause=exc.cause[4:]).inc()
            self._respond(request, METHOD_FAILED, headers=_completion(exc.cause, exc.reason))
            return
        if self._speaking is not None and len(self._queue) >= MAX_QUEUED:
            self._respond(request, METHOD_FAILED, headers=_completion(ERROR, f"{MAX_QUEUED} SPEAKs already queued"))
            return
        if self._speaking is not None:
            self._queue.append(speak)
            self._respond(request, SUCCESS, "PENDING")
            return
        self._start(speak, pending=False)

    def _stop(self, request: MrcpRequest) -> None:
        self._respond(request, SUCCESS, headers=self._end_speaks(_id_list(request)))

    def _barge_in(self, request: MrcpRequest) -> None:
        if self._speaking is None or not self._speaking.kill_on_barge_in:
            self._respond(request, SUCCESS)
            return
        self._respond(request, SUCCESS, headers=self._end_speaks(None))

    def _pause(self, request: MrcpRequest) -> None:
        speaking = self._in_progress(request)
        if not self._paused:
            self._media.pause()
            self._paused = True
        self._respond(request, SUCCESS, headers=(("Active-Request-Id-List", str(speaking.request_id)),))

    def _resume(self, request: MrcpRequest) -> None:
        speaking = self._in_progress(request)
        if self._paused:
            self._paused = False
            self._media.resume()
        self._respond(request, SUCCESS, headers=(("Active-Request-Id-List", str(speaking.request_id)),))

    def _control(self, request: MrcpRequest) -> None:
        # §8.12: changes to the SPEAK in progress (Prosody, Jump-Size); none is applied yet, so 201 (§5.4).
        speaking = self._in_progress(request)
        self._respond(request, SUCCESS_WITH_IGNORE, headers=(("Active-Request-Id-List", str(speaking.request_id)),))

    def _in_progress(self, request: MrcpRequest) -> _Speak:
        if self._speaking is None or not self._speaking.playing:
            raise MessageError(METHOD_NOT_VALID_IN_STATE, f"{request.method} while no SPEAK is in progress",
                               request.request_id, 0)
        return self._speaking

    # -- SPEAK checks --------------------------------------------------------------------------------
    def _checked_speak(self, request: MrcpRequest) -> _Speak:
        values = {**self._params, **params.settable_values(request.request_id, request.headers)}
        kind = media_type(request.headers.get("Content-Type"))
        if not request.body or not kind:
            raise MessageError(MANDATORY_HEADER_MISSING, "SPEAK needs a body with its Content-Type (§8.7)",
                               request.request_id, 0)
        if kind == URI_LIST:
            raise SpeakRefused(URI_FAILURE, "text/uri-list: this server fetches no URIs; send the text or SSML")
        if kind not in TEXT_TYPES + SSML_TYPES:
            raise MessageError(UNSUPPORTED_HEADER_VALUE, f"Content-Type {kind[:40]!r}: expected one of "
                                                         f"{', '.join(TEXT_TYPES + SSML_TYPES)}", request.request_id, 0)
        rate = params.rate_multiplier(values.get("Prosody-Rate", "default"))
        options = {"rate": rate} if rate != 1.0 and getattr(self._engine, "honours_rate", False) else {}
        try:
            synthesis = speak_request(kind, request.body, self._voice(values), call_id=self._call_id, options=options)
        except SpeechTextError as exc:
            raise SpeakRefused(PARSE_FAILURE, str(exc)) from None
        try:
            self._engine.validate(synthesis)
        except (BadText, EmptyText) as exc:
            raise SpeakRefused(PARSE_FAILURE, str(exc)) from None
        except SynthesisRefused as exc:
            raise SpeakRefused(ERROR, str(exc)) from None
        return _Speak(request.request_id, synthesis, values.get("Kill-On-Barge-In", "true") == "true")

    def _voice(self, values: Mapping[str, str]) -> str:
        """Voice-Name (a voice or alias), else a voice for Speech-Language, else the engine's default."""
        if "Voice-Name" in values:
            return self._aliases.get(values["Voice-Name"], values["Voice-Name"])
        language = values.get("Speech-Language")
        if language is None:
            return self._engine.default_voice
        voice = voice_for_language(language, self._engine.voices(), self._aliases)
        if voice is None:
            raise SpeakRefused(LANGUAGE_UNSUPPORTED, f"no voice for Speech-Language {language!r}; "
                                                     "set Voice-Name or add an alias for the language in voices:")
        return voice

    # -- speaking ---------------------------------------------------------------------------------------
    def _start(self, speak: _Speak, pending: bool) -> None:
        self._speaking = speak
        self._paused = False
        speak.task = asyncio.get_running_loop().create_task(self._run(speak, pending),
                                                            name=f"mrcp-speak-{self.channel}-{speak.request_id}")

    async def _run(self, speak: _Speak, pending: bool) -> None:
        cause, reason = NORMAL, None
        speech: Speech | None = None
        try:
            speech = await self._speech.open(speak.synthesis, cacheable=False, rate=self._media.plan.audio_rate)
        except SynthesisRefused as exc:  # no slot, engine down: this SPEAK fails, the session stays
            cause, reason = ERROR, str(exc)
            if not pending:
                self._speaking = None
                metrics.mrcp_speaks_total.labels(cause=cause[4:]).inc()
                self._log.info("mrcp_speak_refused", request_id=speak.request_id, cause=cause, reason=reason)
                self._send_response(speak.request_id, METHOD_FAILED, "COMPLETE", _completion(cause, reason))
                self._next()
                return
        if speech is not None:
            marker = self._marker()
            if pending:  # §8.8 gives no second response; UniMRCP's servers announce the start this way
                self._send(MrcpEvent("SPEECH-MARKER", speak.request_id, "IN-PROGRESS",
                                     self._channel_headers(("Speech-Marker", marker))).serialize())
            else:
                self._send_response(speak.request_id, SUCCESS, "IN-PROGRESS", (("Speech-Marker", marker),))
            self._log.info("mrcp_speak", request_id=speak.request_id, voice=speak.synthesis.voice,
                           chars=len(speak.synthesis.text))
            speak.playing = True
            try:
                await self._media.play(speech.chunks)
            except SynthesisFailed as exc:
                cause, reason = ERROR, str(exc)
            except Exception as exc:  # a bug while playing ends this SPEAK, never the channel
                self._log.exception("mrcp_speak_failed_unexpectedly", request_id=speak.request_id)
                cause, reason = ERROR, repr(exc)
            finally:
                speech.close()
        self._speaking = None
        metrics.mrcp_speaks_total.labels(cause=cause[4:]).inc()
        self._log.info("mrcp_speak_complete", request_id=speak.request_id, cause=cause, reason=reason)
        headers = (*_completion(cause, reason), ("Speech-Marker", self._marker()))
        self._send(MrcpEvent("SPEAK-COMPLETE", speak.request_id, "COMPLETE",
                             self._channel_headers(*headers)).serialize())
        self._next()

    def _next(self) -> None:
        if self._queue and self._speaking is None:
            self._start(self._queue.popleft(), pending=True)

    def _end_speaks(self, ids: set[int] | None) -> tuple[tuple[str, str], ...]:
        """Stop the speaking SPEAK (when `ids` is None or names it) and the queued ones `ids` names (all when
        None); no SPEAK-COMPLETE for them (§8.8). The Active-Request-Id-List header naming them, if any."""
        ended = [speak for speak in self._queue if ids is None or speak.request_id in ids]
        self._queue = deque(speak for speak in self._queue if speak not in ended)
        speaking = self._speaking
        if speaking is not None and (ids is None or speaking.request_id in ids):
            self._media.pause()  # off the clock now: no packet after the response below
            if speaking.task is not None:
                speaking.task.cancel()
            self._speaking = None
            self._paused = False
            ended.insert(0, speaking)
            self._log.info("mrcp_speak_stopped", request_ids=[speak.request_id for speak in ended])
            asyncio.get_running_loop().call_soon(self._next)
        if not ended:
            return ()
        metrics.mrcp_speaks_total.labels(cause="stopped").inc(len(ended))
        return (("Active-Request-Id-List", ",".join(str(speak.request_id) for speak in ended)),)

    def _marker(self) -> str:
        self._last_marker = f"timestamp={int((time.time() + _NTP_EPOCH_OFFSET) * 2**32)}"
        return self._last_marker

    def connection_lost(self, connection: object) -> None:
        """`connection` closed: if it was this channel's, the channel waits for the client to come back."""
        if connection is self._connection:
            self._connection = None
            self.attached.clear()
            self.detached.set()

    async def close(self) -> None:
        """The session ended: stop speaking and drop the queue (the client is gone; nothing is sent)."""
        self._queue.clear()
        speaking, self._speaking = self._speaking, None
        if speaking is not None and speaking.task is not None:
            speaking.task.cancel()
            await asyncio.gather(speaking.task, return_exceptions=True)

    # -- writing -------------------------------------------------------------------------------------
    def _respond(self, request: MrcpRequest, status: int, state: str = "COMPLETE",
                 headers: tuple[tuple[str, str], ...] = ()) -> None:
        self._send_response(request.request_id, status, state, headers)

    def _send_response(self, request_id: int, status: int, state: str, headers: tuple[tuple[str, str], ...]) -> None:
        self._send(MrcpResponse(request_id, status, state, self._channel_headers(*headers)).serialize())

    def _channel_headers(self, *headers: tuple[str, str]) -> tuple[tuple[str, str], ...]:
        return (("Channel-Identifier", self.channel), *headers)


def voice_for_language(language: str, voices: Sequence[str], aliases: Mapping[str, str]) -> str | None:
    """A voice for a language tag: a voice or alias named like the tag, else like its primary subtag
    (en-US -> en), compared case-insensitively."""
    names = {name.lower(): aliases.get(name, name) for name in [*voices, *aliases]}
    tag = language.lower()
    return names.get(tag) or names.get(tag.split("-", 1)[0])


def _completion(cause: str, reason: str | None) -> tuple[tuple[str, str], ...]:
    headers = [("Completion-Cause", cause)]
    if reason:  # §8.4.4: a quoted-string, kept printable and free of quotes and backslashes
        text = "".join(c if c.isprintable() and c not in '"\\' else "?" for c in reason[:200])
        headers.append(("Completion-Reason", f'"{text}"'))
    return tuple(headers)


def _id_list(request: MrcpRequest) -> set[int] | None:
    value = request.headers.get("Active-Request-Id-List")
    if value is None:
        return None
    ids = [part.strip() for part in value.split(",")]
    if not all(part.isdigit() and len(part) <= 10 for part in ids):
        raise MessageError(404, f"Active-Request-Id-List {value[:40]!r}: expected request-ids separated by commas",
                           request.request_id, 0)
    return {int(part) for part in ids}


_HANDLERS: dict[str, Callable[[Synthesizer, MrcpRequest], None]] = {
    "SPEAK": Synthesizer._speak, "STOP": Synthesizer._stop, "PAUSE": Synthesizer._pause,
    "RESUME": Synthesizer._resume, "BARGE-IN-OCCURRED": Synthesizer._barge_in, "CONTROL": Synthesizer._control,
    "SET-PARAMS": Synthesizer._set_params, "GET-PARAMS": Synthesizer._get_params,
}
