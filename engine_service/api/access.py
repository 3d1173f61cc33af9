"""Who is asking, and whether their key has a stream slot free: Bearer authentication and per-key limits.

Wrong keys are limited per source address (`KeyFailures`): past `tts_api.max_key_failures` within
`tts_api.key_failure_window_s`, a source gets 429 with Retry-After and its keys are not even checked until the
window ends. Refused keys are logged once per source per window (the count and the source, never the key).

A stream is one HTTP synthesis response or one open WebSocket (jambonz's or a bot's), from the moment it is
admitted until its response ends or its socket closes, however it ends: `StreamSlots.hold` is a context
manager, so a client that disconnects mid-stream gives its slot back when its handler unwinds. Limits are per
key, counted in this process: one worker's count. With several workers on a host a key may hold max_streams on
each; what keeps calls in on every worker whatever the keys hold is tts_api.reserved_call_slots.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog
from aiohttp import web

from engine_service.api.errors import ApiError
from engine_service.api.settings import ApiKey

if TYPE_CHECKING:
    from engine_service.api.context import TtsApi

log = structlog.get_logger(__name__)


def authenticate(request: web.Request, api: TtsApi) -> ApiKey:
    """The key of `Authorization: Bearer <key>`; 401 (with a challenge, RFC 6750 section 3) otherwise, and 429
    for a source past its failures (KeyFailures)."""
    source = request.remote or "?"
    api.key_failures.check(source)
    header = request.headers.get("Authorization", "")
    scheme, _, secret = header.partition(" ")
    challenge = {"WWW-Authenticate": 'Bearer realm="tts"'}
    if scheme.lower() != "bearer" or not secret.strip():
        api.key_failures.failed(source, "missing_api_key")
        raise ApiError(401, "missing_api_key", "send Authorization: Bearer <api key>", challenge)
    key = api.settings.key_for(secret.strip())
    if key is None:
        api.key_failures.failed(source, "invalid_api_key")
        raise ApiError(401, "invalid_api_key", "the API key is not known", challenge)
    return key


@dataclass
class _Window:
    started: float
    failures: int = 0
    logged: bool = False


@dataclass
class KeyFailures:
    """Failed authentications per source in fixed windows; counts for the worker's metrics."""

    max_failures: int
    window_s: float
    clock: Callable[[], float] = time.monotonic
    refused: int = 0  # keys refused (401)
    limited: int = 0  # requests answered 429 without their key checked
    _windows: dict[str, _Window] = field(default_factory=dict)

    def _window(self, source: str) -> _Window:
        now = self.clock()
        window = self._windows.get(source)
        if window is None or now - window.started >= self.window_s:
            if len(self._windows) > 10_000:  # many sources: forget the finished windows
                self._windows = {key: w for key, w in self._windows.items() if now - w.started < self.window_s}
            window = self._windows[source] = _Window(now)
        return window

    def check(self, source: str) -> None:
        window = self._window(source)
        if window.failures >= self.max_failures:
            self.limited += 1
            retry_after = max(1, math.ceil(window.started + self.window_s - self.clock()))
            raise ApiError(429, "too_many_failed_keys",
                           f"{window.failures} failed keys from this address; try again in {retry_after} s",
                           {"Retry-After": str(retry_after)})

    def failed(self, source: str, reason: str) -> None:
        self.refused += 1
        window = self._window(source)
        window.failures += 1
        if not window.logged:  # once per source per window: a guesser must not write the logs full
            window.logged = True
            log.warning("tts_api_key_refused", source=source, reason=reason, window_s=self.window_s)


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
