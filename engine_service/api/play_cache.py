"""Rendered play-URL prompts kept in the worker's memory, and one render per key however many ask at once.

A `PromptKey` is everything that decides a prompt's samples (text, voice, the engine's model identity for the
voice, the rate, the level), so the same key is the same audio; an entry is that audio as 16-bit PCM at the key's
rate, and each answer encodes its own file type and codec from it. `fill` renders a missing key once: requests
for a key being rendered wait for that render instead of asking the engine again (a PBX that sends one prompt to
forty callers at once costs one synthesis). A failed render is not kept. Entries go least recently used first
past `capacity_bytes`; a prompt bigger than that is served and not kept. Counts (`hits`, `renders`) feed the
worker's metrics.

A stand-in for the shared prompt cache (speech_audio.PromptCache, issue #34's IVR branch) with the same shapes:
its `PromptKey` fields, and a `Render` that awaits admission and returns int16 chunks at the key's rate, so the
play URL moves onto it by replacing `fill` with `open` (and this module goes).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import numpy as np

Render = Callable[[], Awaitable[AsyncIterator[np.ndarray]]]


@dataclass(frozen=True)
class PromptKey:
    text: str
    voice: str
    model: str  # the engine's model identity for the voice: a new model is new audio, so a new ETag
    rate: int
    level: str = "engine"

    @property
    def digest(self) -> str:
        fields = [self.text, self.voice, self.model, self.rate, self.level]
        return hashlib.sha256(json.dumps(fields, ensure_ascii=False).encode("utf-8", "surrogateescape")).hexdigest()


class PlayCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.hits = 0  # prompts served from memory, or from a render another request started
        self.renders = 0  # renders started (the engine asked)
        self._entries: OrderedDict[PromptKey, np.ndarray] = OrderedDict()
        self._size = 0
        self._rendering: dict[PromptKey, asyncio.Future[np.ndarray]] = {}

    @property
    def size_bytes(self) -> int:
        return self._size

    def lookup(self, key: PromptKey) -> np.ndarray | None:
        samples = self._entries.get(key)
        if samples is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return samples

    async def fill(self, key: PromptKey, render: Render) -> np.ndarray:
        """The key's samples: from memory, from a render already running, or from `render()` (kept on success)."""
        if (samples := self.lookup(key)) is not None:
            return samples
        if (running := self._rendering.get(key)) is not None:
            self.hits += 1
            return await asyncio.shield(running)  # one waiter leaving must not cancel the others' render
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()
        self._rendering[key] = future
        self.renders += 1
        try:
            chunks = [chunk async for chunk in await render()]
            samples = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.int16)
        except asyncio.CancelledError:
            future.cancel()
            raise
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: no "never retrieved" warning when nobody else waited
            raise
        finally:
            del self._rendering[key]
        future.set_result(samples)
        self._keep(key, samples)
        return samples

    def _keep(self, key: PromptKey, samples: np.ndarray) -> None:
        if samples.nbytes > self.capacity_bytes:
            return
        self._entries[key] = samples
        self._size += samples.nbytes
        while self._size > self.capacity_bytes:
            _, dropped = self._entries.popitem(last=False)
            self._size -= dropped.nbytes
