"""jambonz's custom TTS vendor API, both halves, exactly as jambonz calls them.

HTTP (the portal's "TTS URL"): `POST /v1/jambonz/tts`, `Authorization: Bearer <key>`, body
`{"language", "voice", "type": "text"|"ssml", "text"}` (mod_custom_tts sends type ssml when the text starts
with `<speak`). Answer: 200 with `Content-Type: audio/l16;rate=<tts_api.jambonz_sample_rate>` and the raw
16-bit PCM streamed as it is made; any failure is an HTTP error code (jambonz plays nothing and reports it).

WebSocket (the portal's "streaming URL"): `GET /v1/jambonz/ws?voice=&language=&sampleRate=` with the Bearer
header. We send `{"type": "connect", "data": {"sample_rate": N, "base64_encoding": false}}` first; jambonz then
sends `{"type": "stream", "text": ...}` pieces, `{"type": "flush"}` to have what it sent spoken, and
`{"type": "stop"}` to end; audio goes back as binary frames of raw PCM16 at N. N is the sampleRate asked for
when we make it (8000/16000/24000), else 24000 and jambonz resamples. A problem mid-session is sent as
`{"type": "error", "error": "..."}` (the shape of jambonz's example vendors) and the session goes on.
Unknown message types are ignored, so a newer jambonz's keepalives do not break a call.

Voices: the jambonz voice name if it is one of ours, else the language's primary subtag ('en-US' -> 'en'),
else the default voice. SSML is spoken as its text until an engine speaks SSML.
"""

from __future__ import annotations

import asyncio
import uuid

import structlog
from aiohttp import WSMsgType, web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import SAMPLE_RATES, AudioEncoder, AudioFormat
from engine_service.api.context import TTS_API
from engine_service.api.errors import ApiError, answers_errors
from engine_service.api.json_body import parse_message, read_json_object, string_field
from engine_service.api.speech import resolve_voice, speech_stream
from engine_service.api.streaming_response import stream_audio
from engine_service.api.text_stream import Sentence, SpokenTextStream

log = structlog.get_logger(__name__)


@answers_errors
async def jambonz_http(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    key = authenticate(request, api)
    body = await read_json_object(request)  # extra fields are ignored: a newer jambonz may add some
    text = string_field(body, "text", required=True)
    ssml = True if string_field(body, "type") == "ssml" else None  # None: SSML when it starts with <speak
    voice = resolve_voice(api.engine, api.settings, string_field(body, "voice"), string_field(body, "language"))
    audio_format = AudioFormat("pcm_s16le", api.settings.jambonz_sample_rate)
    request_id = uuid.uuid4().hex[:16]
    with api.slots.hold(key):
        async with speech_stream(api, text, voice, request_id, ssml) as channel:
            encoder = AudioEncoder(audio_format, api.engine.sample_rate)
            return await stream_audio(request, channel, encoder, audio_format.content_type, request_id, api)


class _JambonzSink:
    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.Transport | None) -> None:
        self._ws = ws
        self._transport = transport

    def cut(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def audio(self, sentence: Sentence, data: bytes) -> None:
        await self._ws.send_bytes(data)

    async def sentence_end(self, sentence: Sentence, audio_bytes: int) -> None:
        """jambonz's protocol has no sentence marks; the audio simply continues."""

    async def error(self, error: ApiError, sentence: Sentence | None) -> None:
        await self._ws.send_json({"type": "error", "error": f"{error.reason}: {error.message}"})


def _session_rate(asked: str | None) -> int:
    if asked is not None and asked.isdigit() and int(asked) in SAMPLE_RATES:
        return int(asked)
    return max(SAMPLE_RATES)


@answers_errors
async def jambonz_websocket(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    key = authenticate(request, api)
    voice = resolve_voice(api.engine, api.settings, request.query.get("voice"), request.query.get("language"))
    audio_format = AudioFormat("pcm_s16le", _session_rate(request.query.get("sampleRate")))
    stream_id = uuid.uuid4().hex[:16]
    with api.slots.hold(key):
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        log.info("tts_jambonz_ws_opened", stream_id=stream_id, key=key.name, voice=voice,
                 sample_rate=audio_format.sample_rate)
        await ws.send_json({"type": "connect",
                            "data": {"sample_rate": audio_format.sample_rate, "base64_encoding": False}})
        sink = _JambonzSink(ws, request.transport)
        spoken = SpokenTextStream(api, voice, audio_format, sink, stream_id)
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    continue
                try:
                    if not await _handle(spoken, message.data):
                        break
                except ApiError as error:
                    await sink.error(error, None)
        except ConnectionError:
            pass
        finally:
            await spoken.close()
            await ws.close()
            log.info("tts_jambonz_ws_closed", stream_id=stream_id)
        return ws


async def _handle(spoken: SpokenTextStream, data: str) -> bool:
    """Act on one jambonz message; False when the session is over."""
    kind, message = parse_message(data)
    if kind == "stream":
        await spoken.push(string_field(message, "text", required=True))
    elif kind == "flush":
        spoken.flush()
    elif kind == "stop":
        return False
    else:
        log.debug("tts_jambonz_ws_message_ignored", type=kind)
    return True
