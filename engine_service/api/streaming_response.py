"""One synthesis sent as one chunked HTTP response, its first bytes leaving with the engine's first chunk.

The status line and headers wait for the first chunk: until then a refusal or an engine failure can still be
a proper JSON error. After that the status is spent, so a mid-stream failure aborts the connection instead of
ending the chunked body (a client must never take half an utterance for a whole one). A client that does not
take its audio in time is cut the same way (client_pace: tts_api.slow_client_timeout_s). A client that goes
away shows as a failed write; the stream is cancelled at once and the handler returns, which frees the key's
slot. (aiohttp does not cancel handlers on disconnect; a stream waiting on its next chunk notices at that
chunk, within one chunk's synthesis time.)
"""

from __future__ import annotations

import time
from contextlib import aclosing

import structlog
from aiohttp import web

from engine_service.api.audio_format import AudioEncoder
from engine_service.api.client_pace import SlowClient, relay
from engine_service.api.context import TtsApi
from engine_service.api.errors import ApiError
from engine_service.api.speech import encoded_audio
from engines.base import SynthesisFailed
from engines.channel import ChunkChannel

log = structlog.get_logger(__name__)

# When the first audio bytes were written (time.monotonic()), for the worker's first-byte histogram
# (engine_service.metrics reads it once the handler returns; an app without metrics ignores it).
FIRST_BYTE_AT = web.RequestKey("first_byte_at", float)


async def stream_audio(request: web.Request, channel: ChunkChannel, encoder: AudioEncoder,
                       content_type: str, request_id: str, api: TtsApi) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": content_type, "Cache-Control": "no-store",
                                           "X-Request-Id": request_id})
    response.enable_chunked_encoding()
    started = time.monotonic()
    sent = 0
    outcome = "completed"

    async def write(data: bytes) -> None:
        if not response.prepared:
            await response.prepare(request)
            request[FIRST_BYTE_AT] = time.monotonic()
        await response.write(data)

    settings = api.settings
    try:
        async with aclosing(encoded_audio(channel, encoder)) as audio:
            sent = await relay(audio, write, settings.slow_client_timeout_s, settings.max_stream_buffer_bytes,
                               api.buffers)
    except SlowClient as slow:
        outcome = "slow_client"
        api.buffers.slow_clients += 1
        log.warning("tts_api_slow_client", request_id=request_id, source=request.remote, problem=str(slow))
        if request.transport is not None:
            request.transport.abort()  # no terminating chunk: the client sees a truncated body
        return response
    except SynthesisFailed as failure:
        outcome = "failed"
        if not response.prepared:
            raise ApiError(500, "synthesis_failed", str(failure)) from None
        if request.transport is not None:
            request.transport.abort()  # no terminating chunk: the client sees a truncated body
        return response
    except ConnectionError:
        outcome = "client_gone"
        return response
    finally:
        log.info("tts_http_stream_ended", request_id=request_id, outcome=outcome, bytes=sent,
                 first_chunk_s=None if channel.first_chunk_at is None else round(channel.first_chunk_at - started, 4),
                 duration_s=round(time.monotonic() - started, 4))
    if not response.prepared:
        await response.prepare(request)
    await response.write_eof()
    return response
