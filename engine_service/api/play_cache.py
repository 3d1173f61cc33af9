"""Rendered play-URL answers kept in the worker's memory, and one render per key however many ask at once.

The key is everything that decides the bytes (`PromptKey`: text, voice, the engine's model identity, the file
type, codec and rate), so the same key is the same audio and its hash is the answer's ETag. `fill` renders a
missing key once: requests for a key that is being rendered wait for that render instead of asking the engine
again (a PBX that sends one prompt to forty callers at once costs one synthesis). A failed render is not kept.
Entries go least recently used first when they pass `capacity_bytes`; an answer bigger than that is served and
not kept. Counts (`hits`, `renders`) feed the worker's metrics.

This is the play URL's own small store, built to be swapped for the shared prompt audio cache (issue #34's
IVR cache) behind the same two calls: `lookup(key)` and `fill(key, render)`.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptKey:
    text: str
    voice: str
    model: str  # the engine's model identity: a new model is new audio, so a new ETag
    file_type: str  # wav, ulaw, alaw, sln
    codec: str  # pcm16, pcmu, pcma
    sample_rate: int

    @property
    def etag(self) -> str:
        """A strong entity tag (RFC 9110 section 8.8.3) from the key's fields, unambiguously joined."""
        fields = (self.text, self.voice, self.model, self.file_type, self.codec, str(self.sample_rate))
        digest = hashlib.sha256("\x00".join(fields).encode("utf-8", "surrogateescape")).hexdigest()
        return f'"{digest[:40]}"'


class PlayCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.hits = 0  # answers served from memory, or from a render another request started
        self.renders = 0  # renders started (the engine asked)
        self._entries: OrderedDict[PromptKey, bytes] = OrderedDict()
        self._size = 0
        self._rendering: dict[PromptKey, asyncio.Future[bytes]] = {}

    @property
    def size_bytes(self) -> int:
        return self._size

    def lookup(self, key: PromptKey) -> bytes | None:
        body = self._entries.get(key)
        if body is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return body

    async def fill(self, key: PromptKey, render: Callable[[], Awaitable[bytes]]) -> bytes:
        """The key's bytes: from memory, from a render already running, or from `render()` (kept on success)."""
        if (body := self.lookup(key)) is not None:
            return body
        if (running := self._rendering.get(key)) is not None:
            self.hits += 1
            return await asyncio.shield(running)  # one waiter leaving must not cancel the others' render
        future: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self._rendering[key] = future
        self.renders += 1
        try:
            body = await render()
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self._rendering[key]
        future.set_result(body)
        self._keep(key, body)
        return body

    def _keep(self, key: PromptKey, body: bytes) -> None:
        if len(body) > self.capacity_bytes:
            return
        self._entries[key] = body
        self._size += len(body)
        while self._size > self.capacity_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._size -= len(dropped)
