"""Prompt audio by URL, for players that fetch and cache media by HTTP: Asterisk `Playback(https://...)`
(res_http_media_cache), FreeSWITCH `http_cache://`, jambonz `play`, the CPaaS `<Play>` verbs.

    GET|HEAD /v1/play.wav?text=...&voice=en&codec=pcm16|pcmu|pcma&rate=8000|16000|24000
    GET|HEAD /v1/play.ulaw | .alaw  (raw G.711, 8000 Hz)   /v1/play.sln?rate=N  (raw 16-bit little-endian)
    auth: Authorization: Bearer <key>, or a signed URL (&key=<name>&exp=<unix time>&sig=<hmac>; signed_url.py)

The path ends in the file type because players pick the format from it (Asterisk's media cache from the
Content-Type, else the URL's extension; FreeSWITCH's from the extension). Defaults: voice the API's default,
codec pcm16, rate 8000. An unknown parameter is a 400 (a typo must not fall back to a default).

Every answer carries a strong `ETag` (the hash of the prompt's key -- text, voice, the engine's model
identity, rate: speech_audio's PromptKey -- with the file type and codec) and `Cache-Control:
max-age=<tts_api.play_url.max_age_s>`; a request whose `If-None-Match` names it gets 304 without the engine.

Prompts come from the worker's prompt cache (speech_audio.PromptCache, the one the gateway's calls use: a miss is
rendered once however many ask at once, counted as tts_api_prompt_cache_*). The body is rendered whole before the
answer starts, so it always has a `Content-Length` and a WAV header with
true sizes. The players this is for download a prompt to a file before they play it (res_http_media_cache
curls to a file, then plays; mod_http_cache likewise), so streaming a miss would not start the audio sooner,
while a WAV header that says "unknown length" is one not every reader takes. A miss's first byte is therefore
the whole render; a hit's is a pack of kept PCM (G.711 by table lookup: well under a millisecond a prompt). That
render is not paced in real time as a live stream's is (SynthesisRequest.paced False: nobody hears it as it comes),
so it runs as fast as the engine can, behind the live streams.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass
from urllib.parse import parse_qsl

import numpy as np
from aiohttp import web

from engine_service.api.access import authenticate
from engine_service.api.audio_format import AudioEncoder, AudioFormat, FormatProblem, wav_header
from engine_service.api.context import TTS_API, TtsApi
from engine_service.api.errors import ApiError, answers_errors
from engine_service.api.settings import ApiKey
from engine_service.api.signed_url import SIGNATURE_PARAMS, signature_problem
from engine_service.api.speech import encoded_audio, resolve_voice, speech_stream
from engine_service.api.streaming_response import FIRST_BYTE_AT
from engines.base import SynthesisFailed
from engines.channel import ChunkChannel
from speech_audio import g711
from speech_audio.prompt_store import PromptKey

FILE_TYPES = ("wav", "ulaw", "alaw", "sln")
ROUTE = "/v1/play.{file_type:" + "|".join(FILE_TYPES) + "}"
_PARAMS = ("text", "voice", "codec", "rate", *SIGNATURE_PARAMS)
_RAW_CODEC = {"ulaw": "pcmu", "alaw": "pcma", "sln": "pcm16"}
_API_FORMAT = {"pcm16": "pcm_s16le", "pcmu": "pcmu", "pcma": "pcma"}  # audio_format's names: its rate checks
LEVEL = "engine"  # the engine's own level: a played file is the player's to level (PromptKey.level)
_CONTENT_TYPES = {"wav": "audio/wav", "ulaw": "audio/basic", "alaw": "audio/x-alaw-basic"}


@dataclass(frozen=True)
class PlayFile:
    """One answer's audio: the prompt, and how its samples are packed."""

    prompt: PromptKey
    file_type: str  # wav, ulaw, alaw, sln
    codec: str  # pcm16, pcmu, pcma

    @property
    def etag(self) -> str:
        """A strong entity tag (RFC 9110 section 8.8.3): the same prompt packed alike is the same bytes."""
        tag = hashlib.sha256(f"{self.prompt.digest}\0{self.file_type}\0{self.codec}".encode()).hexdigest()
        return f'"{tag[:40]}"'

    @property
    def content_type(self) -> str:
        return _CONTENT_TYPES.get(self.file_type, f"audio/l16;rate={self.prompt.rate}")

    def body(self, samples: np.ndarray) -> bytes:
        data = samples.astype("<i2").tobytes() if self.codec == "pcm16" else g711.encode(samples, self.codec.upper())
        if self.file_type == "wav":
            return wav_header(self.prompt.rate, self.codec, len(data)) + data
        return data


@answers_errors
async def play(request: web.Request) -> web.StreamResponse:
    api = request.app[TTS_API]
    query = _single_values(request)
    key = _signed_key(request, api, query) if "sig" in query else authenticate(request, api)
    play_file = _play_file(api, request.match_info["file_type"], query)
    headers = {"ETag": play_file.etag, "Cache-Control": _cache_control(api, signed="sig" in query)}
    if _matches(request.headers.get("If-None-Match"), play_file.etag):
        return web.Response(status=304, headers=headers)
    prompt = play_file.prompt
    audio = await api.prompt_cache.open(prompt, lambda: _render(api, key, prompt))
    samples = audio.samples if audio.samples is not None else _joined([pcm async for pcm in audio.chunks])
    response = web.Response(body=play_file.body(samples), headers={**headers, "Content-Type": play_file.content_type})
    await response.prepare(request)
    request[FIRST_BYTE_AT] = time.monotonic()
    return response


def _joined(chunks: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)


def _single_values(request: web.Request) -> dict[str, str]:
    """The query's parameters, split at '&' or ';' (HTML 4.01 B.2.2): Asterisk's Playback() cuts its argument at
    every '&', so its URLs separate parameters with ';' (written '\\;' in extensions.conf)."""
    query: dict[str, str] = {}
    for piece in re.split("[&;]", request.rel_url.raw_query_string):
        for name, value in parse_qsl(piece, keep_blank_values=True):
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
        if int(query["exp"]) - now > (most := api.settings.play_url.max_signed_ttl_s):
            problem = f"exp: further ahead than tts_api.play_url.max_signed_ttl_s ({most} s)"
        else:
            return key
    api.key_failures.failed(source, "bad_signature")
    raise ApiError(403, "bad_signature", problem)


def _play_file(api: TtsApi, file_type: str, query: dict[str, str]) -> PlayFile:
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
        number = int(rate) if rate.isascii() and rate.isdigit() and len(rate) < 7 else -1  # no '²', no 5000 digits
        AudioFormat.parse(_API_FORMAT[codec], number)
    except FormatProblem as problem:
        raise ApiError(400, "invalid_field", f"rate: {problem}") from None
    voice = resolve_voice(api.engine, api.settings, query.get("voice"))
    return PlayFile(PromptKey(text, voice, api.engine.model_identity(voice), int(rate), LEVEL), file_type, codec)


def _cache_control(api: TtsApi, signed: bool) -> str:
    # A signed URL is its own credential, so shared caches may keep it; a Bearer answer is the key holder's.
    return f"{'public' if signed else 'private'}, max-age={api.settings.play_url.max_age_s}"


def _matches(if_none_match: str | None, etag: str) -> bool:
    """RFC 9110 section 13.1.2: weak comparison, any listed tag or '*'."""
    if not if_none_match:
        return False
    tags = [tag.strip().removeprefix("W/") for tag in if_none_match.split(",")]
    return "*" in tags or etag in tags


async def _render(api: TtsApi, key: ApiKey, prompt: PromptKey) -> AsyncIterator[np.ndarray]:
    """Admit an engine stream for the prompt (refusals raise here, before any answer) and return its audio as
    int16 chunks at the prompt's rate; the key's slot and the stream are held until the chunks end."""
    stack = AsyncExitStack()
    try:
        stack.enter_context(api.slots.hold(key))
        channel = await stack.enter_async_context(speech_stream(api, prompt.text, prompt.voice, uuid.uuid4().hex[:16],
                                                                      paced=False))
    except BaseException:
        await stack.aclose()
        raise
    return _pcm_chunks(stack, channel, AudioEncoder(AudioFormat("pcm_s16le", prompt.rate), api.engine.sample_rate))


async def _pcm_chunks(stack: AsyncExitStack, channel: ChunkChannel, encoder: AudioEncoder) -> AsyncIterator[np.ndarray]:
    async with stack:
        try:
            async for data in encoded_audio(channel, encoder):
                yield np.frombuffer(data, dtype="<i2")
        except SynthesisFailed as failure:
            raise ApiError(500, "synthesis_failed", str(failure)) from None
