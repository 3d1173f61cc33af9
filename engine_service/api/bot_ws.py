"""Our WebSocket for bots: `GET /v1/tts/ws?voice=&format=&sample_rate=` (and, for a CosyVoice3 model, `instruct=` or
`dialect=`: 400 unsupported_option before the upgrade when the model does not take it), text in as an LLM makes it,
audio out.

    client -> server (text frames, JSON)        server -> client
    {"type": "text", "text": "Hel"}             {"type": "ready", "voice", "format", "sample_rate"}  once
    {"type": "flush"}   speak what is pending    binary frames: audio (pcm_s16le, pcmu or pcma), in order
    {"type": "clear"}   barge-in: stop now       {"type": "sentence_end", "index", "text", "audio_bytes"}
                                                 {"type": "cleared"}  after a clear: no older audio follows
                                                 {"type": "error", "error", "message", "index"?}

Sentences are numbered from 0 in the order they are cut; a sentence's audio is every binary frame after the
previous `sentence_end`. An error about one sentence (bad text, engine full) names its index and the stream
goes on with the next. The key's stream slot is held for as long as the socket is open. Authentication is
the Bearer header (browsers cannot set it on a WebSocket: a browser page uses POST /v1/tts).
"""

from __future__ import annotations

import asyncio
import uuid

import structlog
from aiohttp import WSMsgType, web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import AudioFormat, FormatProblem
from engine_service.api.context import TTS_API
from engine_service.api.errors import ApiError, answers_errors
from engine_service.api.json_body import parse_message, string_field
from engine_service.api.speech import engine_options, resolve_voice
from engine_service.api.text_stream import Sentence, SpokenTextStream

log = structlog.get_logger(__name__)


class _BotSink:
    def __init__(self, ws: web.WebSocketResponse, transport: asyncio.Transport | None) -> None:
        self._ws = ws
        self._transport = transport

    def cut(self) -> None:
        if self._transport is not None:
            self._transport.abort()

    async def audio(self, sentence: Sentence, data: bytes) -> None:
        await self._ws.send_bytes(data)

    async def sentence_end(self, sentence: Sentence, audio_bytes: int) -> None:
        await self._ws.send_json({"type": "sentence_end", "index": sentence.index, "text": sentence.text,
                                  "audio_bytes": audio_bytes})

    async def error(self, error: ApiError, sentence: Sentence | None) -> None:
        message = {"type": "error", **error.body()}
        if sentence is not None:
            message["index"] = sentence.index
        await self._ws.send_json(message)


def _query_format(request: web.Request, default_rate: int) -> AudioFormat:
    rate = request.query.get("sample_rate")
    try:
        audio_format = AudioFormat.parse(request.query.get("format", "pcm_s16le"),
                                         int(rate) if rate is not None and rate.isdigit() else rate, default_rate)
    except FormatProblem as problem:
        raise ApiError(400, "invalid_field", f"{problem.field}: {problem}") from None
    if audio_format.name == "wav":
        raise ApiError(400, "invalid_field", "format: a WebSocket carries raw audio: pcm_s16le, pcmu or pcma")
    return audio_format


@answers_errors
async def bot_websocket(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    key = authenticate(request, api)
    audio_format = _query_format(request, api.settings.default_sample_rate)
    voice = resolve_voice(api.engine, api.settings, request.query.get("voice"))
    options = engine_options(api, voice, request.query.get("instruct"), request.query.get("dialect"))
    stream_id = uuid.uuid4().hex[:16]
    with api.slots.hold(key):
        ws = web.WebSocketResponse(heartbeat=30.0)
        await ws.prepare(request)
        log.info("tts_bot_ws_opened", stream_id=stream_id, key=key.name, voice=voice, format=audio_format.name,
                 sample_rate=audio_format.sample_rate)
        sink = _BotSink(ws, request.transport)
        await ws.send_json({"type": "ready", "voice": voice, "format": audio_format.name,
                            "sample_rate": audio_format.sample_rate})
        spoken = SpokenTextStream(api, voice, audio_format, sink, stream_id, options)
        try:
            async for message in ws:
                if message.type != WSMsgType.TEXT:
                    await sink.error(ApiError(400, "bad_message", "send JSON text frames"), None)
                    continue
                try:
                    await _handle(spoken, ws, message.data)
                except ApiError as error:
                    await sink.error(error, None)
        except ConnectionError:
            pass
        finally:
            await spoken.close()
            log.info("tts_bot_ws_closed", stream_id=stream_id)
        return ws


async def _handle(spoken: SpokenTextStream, ws: web.WebSocketResponse, data: str) -> None:
    kind, message = parse_message(data)
    if kind == "text":
        await spoken.push(string_field(message, "text", required=True))
    elif kind == "flush":
        spoken.flush()
    elif kind == "clear":
        await spoken.clear()
        await ws.send_json({"type": "cleared"})
    else:
        raise ApiError(400, "invalid_field", f"type: unknown message type {kind!r}; send text, flush or clear")
