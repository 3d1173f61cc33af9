"""The OpenAI speech API's shape, so OpenAI's clients and the frameworks that take a TTS `base_url` (Pipecat,
LiveKit Agents, vLLM-Omni's clients) speak through us unchanged.

    POST /v1/audio/speech {"model", "input", "voice", "response_format"?, "speed"?, "instructions"?, "stream_format"?}
    GET  /v1/audio/voices -> {"voices": [names], "data": [{"id", "name", "object": "voice"}], "default": name}

`model` must be a non-empty string and is otherwise not looked at ("tts-1" or anything: the worker serves one
model). `voice` is one of the engine's voices (GET /v1/audio/voices; OpenAI's own names such as "alloy" are
refused with the list), or `{"id": name}`. `response_format`: "mp3" (OpenAI's default; 64 kbit/s mono through
LAME), "wav" (its header says "unknown length", as OpenAI's streamed wav does) or "pcm" (raw 16-bit
little-endian at 24 kHz, like OpenAI's); opus, aac and flac are refused naming these three. `speed` 1.0 only:
no engine of ours changes its speaking rate, and a faked one (resampling) would change the pitch.
`instructions` is accepted and not used (no engine takes style prompts). `stream_format` "audio" (default) streams
the bytes by chunked transfer as they are made; "sse" sends `speech.audio.delta` events (base64 audio) and one
`speech.audio.done`, as OpenAI does.

Errors come in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with the status its clients
map to typed exceptions (400 BadRequestError, 401 AuthenticationError, 429 RateLimitError, 5xx
InternalServerError); `code` is our reason word. Admission, slots and limits are the speech API's own
(speech.speech_stream), as for POST /v1/tts.
"""

from __future__ import annotations

import base64
import functools
import json
import uuid
from typing import Any

import lameenc
import numpy as np
from aiohttp import web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import AudioEncoder, AudioFormat
from engine_service.api.context import TTS_API
from engine_service.api.errors import ApiError, Handler, answers_errors
from engine_service.api.json_body import read_json_object, string_field
from engine_service.api.speech import resolve_voice, speech_stream
from engine_service.api.streaming_response import stream_audio

RESPONSE_FORMATS = ("mp3", "wav", "pcm")
OPENAI_RATE = 24000  # OpenAI's pcm and wav are 24 kHz; its clients assume it
_FIELDS = ("model", "input", "voice", "response_format", "speed", "instructions", "stream_format")
_CONTENT_TYPES = {"mp3": "audio/mpeg", "wav": "audio/wav", "pcm": "audio/pcm"}
_MP3_KBITS = 64


def openai_errors(handler: Handler) -> Handler:
    """The speech API's errors (answers_errors logs them), re-shaped as OpenAI's."""
    inner = answers_errors(handler)

    @functools.wraps(handler)
    async def wrapped(request: web.Request) -> web.StreamResponse:
        response = await inner(request)
        if response.status < 400 or not isinstance(response, web.Response) or response.body is None:
            return response
        ours = json.loads(response.body)
        status = 400 if response.status == 413 else response.status  # OpenAI answers too-long input with 400
        headers = {name: value for name, value in response.headers.items()
                   if name in ("Retry-After", "WWW-Authenticate")}
        return web.json_response({"error": _openai_error(status, ours["error"], ours["message"])}, status=status,
                                 headers=headers)

    return wrapped


def _openai_error(status: int, reason: str, message: str) -> dict[str, Any]:
    field, _, _ = message.partition(":")
    param = field if field in _FIELDS else ("voice" if reason == "unknown_voice" else None)
    if reason in ("text_too_long", "empty_text", "bad_text"):
        param = "input"
    kind = ("invalid_request_error" if status < 429 else "rate_limit_error" if status == 429 else "server_error")
    return {"message": message.replace("text:", "input:", 1) if param == "input" else message,
            "type": kind, "param": param, "code": reason}


@openai_errors
async def openai_speech(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    key = authenticate(request, api)
    body = await read_json_object(request)
    if unknown := sorted(set(body) - set(_FIELDS)):
        raise ApiError(400, "invalid_field", f"{unknown[0]}: unrecognized request argument")
    if not string_field(body, "model", required=True):
        raise ApiError(400, "invalid_field", "model: must not be empty")
    text = string_field(body, "input", required=True)
    voice = resolve_voice(api.engine, api.settings, _voice_name(body), None)
    response_format = string_field(body, "response_format") or "mp3"
    if response_format not in RESPONSE_FORMATS:
        raise ApiError(400, "invalid_field", f"response_format: {response_format!r} is not offered here; "
                                             f"choose one of {', '.join(RESPONSE_FORMATS)}")
    speed = body.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, int | float) or speed != 1.0:
        raise ApiError(400, "invalid_field", "speed: only 1.0 is supported (the engine has no speaking-rate control)")
    string_field(body, "instructions")  # accepted, unused: see the module's docstring
    stream_format = string_field(body, "stream_format") or "audio"
    if stream_format not in ("audio", "sse"):
        raise ApiError(400, "invalid_field", f"stream_format: {stream_format!r}; choose audio or sse")
    encoder = _encoder(response_format, api.engine.sample_rate)
    content_type = _CONTENT_TYPES[response_format]
    if stream_format == "sse":
        encoder, content_type = SseEncoder(encoder), "text/event-stream"
    request_id = uuid.uuid4().hex[:16]
    with api.slots.hold(key):
        async with speech_stream(api, text, voice, request_id) as channel:
            return await stream_audio(request, channel, encoder, content_type, request_id, api)


def _voice_name(body: dict[str, Any]) -> str:
    voice = body.get("voice")
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):  # OpenAI's custom-voice form
        voice = voice["id"]
    if not isinstance(voice, str) or not voice:
        raise ApiError(400, "invalid_field", "voice: required, a voice name (GET /v1/audio/voices)")
    return voice


def _encoder(response_format: str, source_rate: int) -> AudioEncoder | Mp3Encoder:
    if response_format == "mp3":
        return Mp3Encoder(source_rate)
    return AudioEncoder(AudioFormat("wav" if response_format == "wav" else "pcm_s16le", OPENAI_RATE), source_rate)


class Mp3Encoder:
    """Engine chunks -> MP3 frames as they fill (LAME buffers about one frame, 24 ms at 24 kHz)."""

    def __init__(self, source_rate: int) -> None:
        self._pcm = AudioEncoder(AudioFormat("pcm_s16le", OPENAI_RATE), source_rate)
        self._lame = lameenc.Encoder()
        self._lame.set_bit_rate(_MP3_KBITS)
        self._lame.set_in_sample_rate(OPENAI_RATE)
        self._lame.set_channels(1)
        self._lame.set_quality(2)

    def encode(self, chunk: np.ndarray) -> bytes:
        return bytes(self._lame.encode(self._pcm.encode(chunk)))

    def finish(self) -> bytes:
        return bytes(self._lame.encode(self._pcm.finish())) + bytes(self._lame.flush())


class SseEncoder:
    """Any encoder's bytes as OpenAI's server-sent events: a delta per piece, then done."""

    def __init__(self, inner: AudioEncoder | Mp3Encoder) -> None:
        self._inner = inner

    def encode(self, chunk: np.ndarray) -> bytes:
        return self._delta(self._inner.encode(chunk))

    def finish(self) -> bytes:
        done = {"type": "speech.audio.done", "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}
        return self._delta(self._inner.finish()) + _event(done)

    @staticmethod
    def _delta(data: bytes) -> bytes:
        return _event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode()}) if data else b""


def _event(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


@openai_errors
async def openai_voices(request: web.Request) -> web.Response:
    api = request.app[TTS_API]
    authenticate(request, api)
    names = list(api.engine.voices())
    return web.json_response({"voices": names, "default": api.settings.default_voice or api.engine.default_voice,
                              "data": [{"id": name, "name": name, "object": "voice"} for name in names],
                              "object": "list"})
