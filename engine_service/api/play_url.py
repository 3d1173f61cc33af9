"""Prompt audio by URL, for players that fetch and cache media by HTTP: Asterisk `Playback(https://...)`
(res_http_media_cache), FreeSWITCH `http_cache://`, jambonz `play`, the CPaaS `<Play>` verbs.

    GET|HEAD /v1/play.wav?text=...&voice=en&codec=pcm16|pcmu|pcma&rate=8000|16000|24000
    GET|HEAD /v1/play.ulaw | .alaw  (raw G.711, 8000 Hz)   /v1/play.sln?rate=N  (raw 16-bit little-endian)
    auth: Authorization: Bearer <key>, or a signed URL (&key=<name>&exp=<unix time>&sig=<hmac>; signed_url.py)

The path ends in the file type because players pick the format from it (Asterisk's media cache from the
Content-Type, else the URL's extension; FreeSWITCH's from the extension). Defaults: voice the API's default,
codec pcm16, rate 8000. An unknown parameter is a 400 (a typo must not fall back to a default).

Every answer carries a strong `ETag` (the hash of text, voice, the engine's model identity, file type, codec
and rate: see play_cache.PromptKey) and `Cache-Control: max-age=<tts_api.play_url.max_age_s>`; a request whose
`If-None-Match` names it gets 304 without the engine. The body is rendered whole before the answer starts, so
it always has a `Content-Length` and a WAV header with true sizes: the players this is for download a prompt to
a file before playing it (none plays while downloading), and some refuse or misplay a WAV whose header says
"unknown length" (Asterisk's format_wav reads the data size), so streaming a miss would buy no earlier audio
and cost correctness. A miss's first byte is therefore the whole render; a hit's is a memory copy.
"""

from __future__ import annotations

import time
import uuid

from aiohttp import web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import AudioEncoder, AudioFormat, FormatProblem, wav_header
from engine_service.api.context import TTS_API, TtsApi
from engine_service.api.errors import ApiError, answers_errors
from engine_service.api.play_cache import PromptKey
from engine_service.api.settings import ApiKey
from engine_service.api.signed_url import SIGNATURE_PARAMS, signature_problem
from engine_service.api.speech import encoded_audio, resolve_voice, speech_stream
from engine_service.api.streaming_response import FIRST_BYTE_AT
from engines.base import SynthesisFailed

FILE_TYPES = ("wav", "ulaw", "alaw", "sln")
ROUTE = "/v1/play.{file_type:" + "|".join(FILE_TYPES) + "}"
_PARAMS = ("text", "voice", "codec", "rate", *SIGNATURE_PARAMS)
_RAW_CODEC = {"ulaw": "pcmu", "alaw": "pcma", "sln": "pcm16"}
_API_FORMAT = {"pcm16": "pcm_s16le", "pcmu": "pcmu", "pcma": "pcma"}  # audio_format's names for the codecs
_CONTENT_TYPES = {"wav": "audio/wav", "ulaw": "audio/basic", "alaw": "audio/x-alaw-basic"}


@answers_errors
async def play(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    query = _single_values(request)
    key = _signed_key(request, api, query) if "sig" in query else authenticate(request, api)
    prompt = _prompt_key(api, request.match_info["file_type"], query)
    headers = {"ETag": prompt.etag, "Cache-Control": _cache_control(api, signed="sig" in query)}
    if _matches(request.headers.get("If-None-Match"), prompt.etag):
        return web.Response(status=304, headers=headers)
    body = api.play_cache.lookup(prompt)
    if body is None:
        body = await api.play_cache.fill(prompt, lambda: _render(api, key, prompt))
    content_type = _CONTENT_TYPES.get(prompt.file_type, f"audio/l16;rate={prompt.sample_rate}")
    response = web.Response(body=body, headers={**headers, "Content-Type": content_type})
    await response.prepare(request)
    request[FIRST_BYTE_AT] = time.monotonic()
    return response


def _single_values(request: web.Request) -> dict[str, str]:
    query: dict[str, str] = {}
    for name, value in request.query.items():
        if name not in _PARAMS:
            raise ApiError(400, "invalid_field", f"{name}: unknown parameter; known: {', '.join(_PARAMS)}")
        if name in query:
            raise ApiError(400, "invalid_field", f"{name}: given twice")
        query[name] = value
    return query


def _signed_key(request: web.Request, api: TtsApi, query: dict[str, str]) -> ApiKey:
    """The key named by a signed URL whose signature and expiry hold; 403 otherwise (counted as a failed key)."""
    source = request.remote or "?"
    api.key_failures.check(source)
    key = api.settings.key_named(query.get("key", ""))
    now = time.time()
    if key is None:
        problem = "key: no API key of that name"
    elif (problem := signature_problem(key.key, request.path, query, now)) is None:
        if int(query["exp"]) - now > api.settings.play_url.max_signed_ttl_s:
            problem = f"exp: further ahead than tts_api.play_url.max_signed_ttl_s ({api.settings.play_url.max_signed_ttl_s} s)"
        else:
            return key
    api.key_failures.failed(source, "bad_signature")
    raise ApiError(403, "bad_signature", problem)


def _prompt_key(api: TtsApi, file_type: str, query: dict[str, str]) -> PromptKey:
    text = query.get("text")
    if not text:
        raise ApiError(400, "invalid_field", "text: required")
    codec = query.get("codec", "pcm16") if file_type == "wav" else _RAW_CODEC[file_type]
    if file_type != "wav" and "codec" in query and query["codec"] != codec:
        raise ApiError(400, "invalid_field", f"codec: a .{file_type} file is {codec}")
    if codec not in _API_FORMAT:
        raise ApiError(400, "invalid_field", f"codec: unknown codec {codec!r}; choose one of pcm16, pcmu, pcma")
    rate = query.get("rate", "8000")
    try:
        AudioFormat.parse(_API_FORMAT[codec], int(rate) if rate.isdigit() else -1)
    except FormatProblem as problem:
        raise ApiError(400, "invalid_field", f"rate: {problem}") from None
    voice = resolve_voice(api.engine, api.settings, query.get("voice"))
    # The model identity keeps an ETag from outliving the model that made the audio; an engine without one is
    # known by its name (espeak, instant: one model each).
    model = getattr(api.engine, "model_identity", None) or api.engine.name
    return PromptKey(text, voice, model, file_type, codec, int(rate))


def _cache_control(api: TtsApi, signed: bool) -> str:
    # A signed URL is its own credential, so shared caches may keep it; a Bearer answer is the key holder's.
    return f"{'public' if signed else 'private'}, max-age={api.settings.play_url.max_age_s}"


def _matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 section 13.1.2: weak comparison, any listed tag or '*'."""
    if not if_none_match:
        return False
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags


async def _render(api: TtsApi, key: ApiKey, prompt: PromptKey) -> bytes:
    audio_format = AudioFormat(_API_FORMAT[prompt.codec], prompt.sample_rate)
    with api.slots.hold(key):
        async with speech_stream(api, prompt.text, prompt.voice, uuid.uuid4().hex[:16]) as channel:
            encoder = AudioEncoder(audio_format, api.engine.sample_rate)
            try:
                data = b"".join([piece async for piece in encoded_audio(channel, encoder)])
            except SynthesisFailed as failure:
                raise ApiError(500, "synthesis_failed", str(failure)) from None
    if prompt.file_type == "wav":
        return wav_header(prompt.sample_rate, prompt.codec, len(data)) + data
    return data
