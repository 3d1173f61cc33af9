"""Opening one engine stream for the API, with every refusal settled before any audio is promised.

`speech_stream` checks what the API owns (text length, the engine's health, a slot shared with the worker's
gateway links when the worker passes `SharedSlots`), opens the stream, and waits for the engine's admission at
most `admission_timeout_s`: an engine that neither takes nor refuses a stream in that
time is treated as full (503 with Retry-After), so no client is left on a silent socket. Refusals come back as
`ApiError`s. `encoded_audio` relays the admitted stream's chunks as encoded bytes and always cancels the
stream when its consumer stops, whether it finished, failed, or the client went away, so the engine's work
is freed at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

from engine_service.api.audio_format import AudioEncoder
from engine_service.api.context import TtsApi
from engine_service.api.errors import ApiError, refusal_error, unavailable
from engine_service.api.settings import TtsApiSettings
from engines.base import SpeechEngine, SynthesisRefused, SynthesisRequest
from engines.channel import ChunkChannel
from engines.segmented import speech_request
from engines.ssml import SsmlError


def resolve_voice(engine: SpeechEngine, settings: TtsApiSettings, voice: str | None,
                  language: str | None = None) -> str:
    """The voice asked for; else one named by the language's primary subtag ('en-US' -> 'en'); else default.

    A voice that is named but unknown is refused, never silently replaced: the caller asked for it."""
    known = engine.voices()
    if voice:
        if voice in known:
            return voice
        raise ApiError(400, "unknown_voice", f"voice: unknown voice {voice!r}; known: {', '.join(sorted(known))}")
    if language:
        primary = language.split("-")[0].split("_")[0].lower()
        if primary in known:
            return primary
    return settings.default_voice or engine.default_voice


def engine_options(api: TtsApi, voice: str, instruct: str | None, dialect: str | None) -> dict[str, str]:
    """A request's instruct / dialect as engine options, checked by the engine now (400 unsupported_option: a
    name off the model's list, both, or a model that takes none), so a stream of many texts is refused at once."""
    options = {key: value for key, value in (("instruct", instruct), ("dialect", dialect)) if value is not None}
    if options:
        try:
            api.engine.validate(SynthesisRequest(text="a", voice=voice, options=options))
        except SynthesisRefused as refusal:
            raise refusal_error(refusal, api.settings.retry_after_s) from None
    return options


@asynccontextmanager
async def speech_stream(api: TtsApi, text: str, voice: str, request_id: str = "",
                        ssml: bool | None = False, options: Mapping[str, Any] | None = None,
                        paced: bool = True) -> AsyncIterator[ChunkChannel]:
    """An admitted engine stream for the body of the `async with`; cancelled, and its shared slot given back,
    when the body ends however it ends. `ssml`: True reads the text as SSML, None when it starts with `<speak`
    (engines.segmented.speech_request); a document that cannot be spoken is a 400 `bad_ssml`. `options`: the
    request's engine options (instruct / dialect), checked by the engine (400 unsupported_option). `paced` False:
    the caller collects the audio whole before use (SynthesisRequest.paced), e.g. a play-URL file."""
    settings = api.settings
    if len(text) > settings.max_text_chars:
        raise ApiError(413, "text_too_long",
                       f"text: {len(text)} characters, the limit is {settings.max_text_chars}")
    try:
        request = replace(speech_request(text, voice, call_id=request_id, ssml=ssml, options=options), paced=paced)
    except SsmlError as exc:
        raise ApiError(400, "bad_ssml", str(exc)) from None
    health = api.engine.health()
    if not health.accepting:
        reason = "engine_unavailable" if health.state != "ready" else "at_capacity"
        raise unavailable(reason, health.reason or f"engine is {health.state}, no slot free", settings.retry_after_s)
    if api.shared_slots is not None and not api.shared_slots.take(settings.reserved_call_slots):
        reserved = f" (the last {settings.reserved_call_slots} are kept for calls)" if settings.reserved_call_slots \
            else ""
        raise unavailable("at_capacity", f"every engine slot of this worker the API may use is in use{reserved}",
                          settings.retry_after_s)
    try:
        channel = await _admitted_stream(api, request)
        if api.stream_events is not None:
            api.stream_events.opened()
        try:
            yield channel
        finally:
            channel.cancel()
            if api.stream_events is not None:  # not read to its end nor to a failure: the client stopped it
                api.stream_events.ended(channel.outcome or "cancelled")
    finally:
        if api.shared_slots is not None:
            api.shared_slots.give_back()


async def _admitted_stream(api: TtsApi, request: SynthesisRequest) -> ChunkChannel:
    settings = api.settings
    try:
        channel = api.engine.open_stream(request)
    except SynthesisRefused as refusal:
        raise refusal_error(refusal, settings.retry_after_s) from None
    try:
        await asyncio.wait_for(channel.admitted(), settings.admission_timeout_s)
    except SynthesisRefused as refusal:
        channel.cancel()
        raise refusal_error(refusal, settings.retry_after_s) from None
    except TimeoutError:
        channel.cancel()
        raise unavailable("at_capacity", f"the engine did not take the stream within "
                          f"{settings.admission_timeout_s:g} s", settings.retry_after_s) from None
    except BaseException:
        channel.cancel()
        raise
    return channel


async def encoded_audio(channel: ChunkChannel, encoder: AudioEncoder) -> AsyncIterator[bytes]:
    """Encoded bytes per engine chunk, then the encoder's tail; raises SynthesisFailed from the engine."""
    try:
        async for chunk in channel:
            if data := encoder.encode(chunk):
                yield data
        if tail := encoder.finish():
            yield tail
    finally:
        channel.cancel()
