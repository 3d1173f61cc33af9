"""Who is asking, and whether their key has a stream slot free: Bearer authentication and per-key limits.

A stream is one HTTP synthesis response or one open WebSocket (jambonz's or a bot's), from the moment it is
admitted until its response ends or its socket closes, however it ends: `StreamSlots.hold` is a context
manager, so a client that disconnects mid-stream gives its slot back when its handler unwinds. Limits are per
key, counted in this process (one worker process serves one engine, so this is the engine's whole count).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from engine_service.api.errors import ApiError
from engine_service.api.settings import ApiKey, TtsApiSettings


def authenticate(request: web.Request, settings: TtsApiSettings) -> ApiKey:
    """The key of `Authorization: Bearer <key>`; 401 (with a challenge, RFC 6750 section 3) otherwise."""
    header = request.headers.get("Authorization", "")
    scheme, _, secret = header.partition(" ")
    challenge = {"WWW-Authenticate": 'Bearer realm="tts"'}
    if scheme.lower() != "bearer" or not secret.strip():
        raise ApiError(401, "missing_api_key", "send Authorization: Bearer <api key>", challenge)
    key = settings.key_for(secret.strip())
    if key is None:
        raise ApiError(401, "invalid_api_key", "the API key is not known", challenge)
    return key


class StreamSlots:
    """Concurrent streams per key name."""

    def __init__(self) -> None:
        self._in_use: dict[str, int] = {}

    def in_use(self, key_name: str) -> int:
        return self._in_use.get(key_name, 0)

    @contextmanager
    def hold(self, key: ApiKey) -> Iterator[None]:
        if self.in_use(key.name) >= key.max_streams:
            raise ApiError(429, "too_many_streams",
                           f"key {key.name!r} already has {key.max_streams} streams open (its max_streams)")
        self._in_use[key.name] = self.in_use(key.name) + 1
        try:
            yield
        finally:
            self._in_use[key.name] -= 1
