"""`add_tts_routes`: the one call the worker's server makes to put the TTS API on its application.

    GET  /                  a page to try a voice in a browser
    GET  /v1/voices         the engine's voices, formats and rates
    POST /v1/tts            one text -> streamed audio (wav, pcm_s16le, pcmu, pcma at 8/16/24 kHz)
    GET  /v1/tts/ws         bot WebSocket: text pieces in, audio per sentence out, flush and clear
    POST /v1/jambonz/tts    jambonz custom TTS vendor, HTTP
    GET  /v1/jambonz/ws     jambonz custom TTS vendor, streaming WebSocket
    GET  /v1/play.wav       prompt audio by URL, cacheable (ETag, max-age, 304); also .ulaw .alaw .sln; HEAD too
    POST /v1/audio/speech   OpenAI-compatible speech (its clients and frameworks, unchanged)
    GET  /v1/audio/voices   the engine's voices, for OpenAI-style clients

Every /v1 route needs `Authorization: Bearer <key>` from `tts_api.api_keys` (a play URL may carry a signature
made with a key instead); the page itself is public and asks for a key. Nothing here starts or stops the
engine: the worker owns its lifecycle.
"""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from engine_service.api.bot_ws import bot_websocket
from engine_service.api.context import TTS_API, SharedSlots, TtsApi
from engine_service.api.errors import json_route_errors
from engine_service.api.http_tts import get_voices, post_tts
from engine_service.api.jambonz import jambonz_http, jambonz_websocket
from engine_service.api.openai_speech import openai_speech, openai_voices
from engine_service.api.play_url import ROUTE as PLAY_ROUTE
from engine_service.api.play_url import play
from engine_service.api.settings import TtsApiSettings
from engines.base import SpeechEngine

_PAGE = web.AppKey("tts_api_page", bytes)


def add_tts_routes(app: web.Application, engine: SpeechEngine, settings: TtsApiSettings,
                   shared_slots: SharedSlots | None = None) -> None:
    """Add the routes; `shared_slots` lets API streams count against the worker's own slots (see SharedSlots)."""
    if settings.default_voice is not None and settings.default_voice not in engine.voices():
        raise ValueError(f"tts_api.default_voice: {settings.default_voice!r} is not a voice of the "
                         f"{engine.name} engine ({', '.join(engine.voices())})")
    app.middlewares.append(json_route_errors)  # 404/405 as every other refusal: {"error", "message"}
    app[TTS_API] = TtsApi(engine, settings, shared_slots)
    app.on_cleanup.append(_close_prompt_cache)
    app[_PAGE] = resources.files("engine_service.api").joinpath("try_voice.html").read_bytes()
    app.router.add_get("/", _try_voice_page)
    app.router.add_get("/v1/voices", get_voices)
    app.router.add_post("/v1/tts", post_tts)
    app.router.add_get("/v1/tts/ws", bot_websocket)
    app.router.add_post("/v1/jambonz/tts", jambonz_http)
    app.router.add_get("/v1/jambonz/ws", jambonz_websocket)
    app.router.add_get(PLAY_ROUTE, play)  # HEAD too (aiohttp's allow_head): same headers, no body
    app.router.add_post("/v1/audio/speech", openai_speech)
    app.router.add_get("/v1/audio/voices", openai_voices)


async def _close_prompt_cache(app: web.Application) -> None:
    await app[TTS_API].prompt_cache.close()  # a fill still rendering must not outlive the engine it reads


async def _try_voice_page(request: web.Request) -> web.Response:
    return web.Response(body=request.app[_PAGE], content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-cache"})
