"""Our own HTTP endpoints: `POST /v1/tts` streams one text's audio, `GET /v1/voices` lists what it may use.

    POST /v1/tts  {"text": "...", "voice"?: "en", "format"?: "wav|pcm_s16le|pcmu|pcma", "sample_rate"?: 8000|16000|24000,
                   "instruct"?: "happy", "dialect"?: "sichuan"}  (instruct / dialect: CosyVoice3 models only)
    -> 200, chunked, Content-Type audio/wav | audio/l16;rate=N | audio/PCMU;rate=8000 | audio/PCMA;rate=8000

Order of checks (each its own JSON error): key (401), body (400 bad_json / invalid_field), format (400),
voice (400 unknown_voice), the key's stream slots (429), text length and engine (413, 400, 503; an instruct or
dialect the model does not take, or not on its list, 400 unsupported_option).
"""

from __future__ import annotations

import uuid

from aiohttp import web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import FORMATS, SAMPLE_RATES, AudioEncoder, AudioFormat, FormatProblem
from engine_service.api.context import TTS_API
from engine_service.api.errors import ApiError, answers_errors
from engine_service.api.json_body import int_field, read_json_object, refuse_unknown_fields, string_field
from engine_service.api.speech import engine_options, resolve_voice, speech_stream
from engine_service.api.streaming_response import stream_audio

_TTS_FIELDS = ("text", "voice", "format", "sample_rate", "instruct", "dialect")


@answers_errors
async def post_tts(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    key = authenticate(request, api)
    body = await read_json_object(request)
    refuse_unknown_fields(body, _TTS_FIELDS)
    text = string_field(body, "text", required=True)
    try:
        audio_format = AudioFormat.parse(string_field(body, "format"), int_field(body, "sample_rate"),
                                        api.settings.default_sample_rate)
    except FormatProblem as problem:
        raise ApiError(400, "invalid_field", f"{problem.field}: {problem}") from None
    voice = resolve_voice(api.engine, api.settings, string_field(body, "voice"))
    options = engine_options(api, voice, string_field(body, "instruct"), string_field(body, "dialect"))
    request_id = uuid.uuid4().hex[:16]
    with api.slots.hold(key):
        async with speech_stream(api, text, voice, request_id, ssml=None, options=options) as channel:
            encoder = AudioEncoder(audio_format, api.engine.sample_rate)
            return await stream_audio(request, channel, encoder, audio_format.content_type, request_id, api)


@answers_errors
async def get_voices(request: web.Request) -> web.Response:
    api = request.app[TTS_API]
    authenticate(request, api)
    return web.json_response({
        "voices": [{"name": name} for name in api.engine.voices()],
        "default_voice": api.settings.default_voice or api.engine.default_voice,
        "formats": list(FORMATS),
        "sample_rates": list(SAMPLE_RATES),
        "engine": api.engine.name,
    })
