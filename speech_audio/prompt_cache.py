"""The prompt cache: a prompt's line audio rendered once per `PromptKey`, then played from the store.

`PromptCache.open(key, render)` is the one call every way in uses (a SIP call in the gateway, the speech API in a
worker). It answers, in this order:

1. a hit in memory, or in the store's directory (read on a worker thread): the whole prompt at once
   (`PromptAudio.hit`, `samples`); the engine is not asked and no engine slot is taken;
2. a fill of the same key already running (another caller missed a moment ago): the audio streams from that fill,
   from its first sample, as it arrives; no second synthesis (single flight). If that fill's render was refused
   (no engine slot...), this caller gets the same refusal;
3. a miss: `render()` is awaited (it opens the engine stream and waits for its admission, so its refusal reaches
   this caller before anything is answered) and returns an async iterator of int16 chunks at `key.rate`; a fill
   task reads it to its end and streams it to this caller and any who join. The fill runs to the end even if every
   listener hangs up (the work is the cache's, the next caller plays it), then the entry is kept in memory and
   written to disk. A render that fails mid-way fails its listeners and stores nothing.

A speech adapter (the gateway's `gateway/speech.py`; the speech API in a worker) uses it like this, for any rate:

    key = PromptKey(text, voice, engine.model_identity(voice), rate, level_label)   # level_label: "-19.0"/"engine"
    async def render():                       # only on a miss; raise the engine's refusal here
        channel = engine.open_stream(request); await channel.admitted()
        return line_chunks(channel, LineAudio(engine.sample_rate, rate, gain_db))   # int16 at `rate`
    audio = await cache.open(key, render)     # audio.hit, audio.samples (hit), audio.chunks (always)
    async for pcm in audio.chunks: ...        # encode pcm to the client's format

Counts: `hits` by where (memory, disk, in_flight), `misses` (renders admitted), `fill_failures`; the store counts
bytes, evictions and corrupt files. Runs on one event loop; the store's disk work goes to threads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import structlog

from speech_audio.prompt_store import PromptKey, PromptStore

log = structlog.get_logger(__name__)

Render = Callable[[], Awaitable[AsyncIterator[np.ndarray]]]


@dataclass
class PromptAudio:
    """What `open` gives: `chunks` (int16 at the key's rate) to play; on a hit also `samples`, the whole prompt."""

    hit: bool
    chunks: AsyncIterator[np.ndarray]
    samples: np.ndarray | None = None


class CacheClosed(RuntimeError):
    """The cache was closed while a fill was still running."""


@dataclass
class _Fill:
    chunks: list[np.ndarray] = field(default_factory=list)
    opened: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    done: bool = False
    error: BaseException | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def _wake(self) -> None:
        woken, self.changed = self.changed, asyncio.Event()
        woken.set()

    def push(self, pcm: np.ndarray) -> None:
        self.chunks.append(pcm)
        self._wake()

    def end(self, error: BaseException | None = None) -> None:
        self.done, self.error = True, error
        self._wake()

    async def read(self) -> AsyncIterator[np.ndarray]:
        """Every chunk from the first, then each new one as it arrives; raises the render's error."""
        index = 0
        while True:
            changed = self.changed
            while index < len(self.chunks):
                yield self.chunks[index]
                index += 1
            if self.done:
                if self.error is not None:
                    raise self.error
                return
            await changed.wait()


async def _once(samples: np.ndarray) -> AsyncIterator[np.ndarray]:
    yield samples


class PromptCache:
    def __init__(self, store: PromptStore) -> None:
        self.store = store
        self._fills: dict[str, _Fill] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self.hits = {"memory": 0, "disk": 0, "in_flight": 0}
        self.misses = 0
        self.fill_failures = 0

    async def lookup(self, key: PromptKey) -> np.ndarray | None:
        """The whole prompt if it is kept (memory, then disk), else None; counts a hit, never a miss."""
        samples = self.store.memory_get(key)
        if samples is not None:
            self.hits["memory"] += 1
            return samples
        if self.store.directory is None or key.digest in self._fills:
            return None
        samples = await asyncio.to_thread(self.store.disk_get, key)
        if samples is not None:
            self.hits["disk"] += 1
        return samples

    async def open(self, key: PromptKey, render: Render) -> PromptAudio:
        samples = await self.lookup(key)
        if samples is None:  # a fill may have finished while the disk was read
            samples = self.store.memory_get(key)
        if samples is not None:
            return PromptAudio(True, _once(samples), samples)
        fill = self._fills.get(key.digest)
        if fill is not None:
            await asyncio.shield(fill.opened)  # the first caller's refusal is this caller's too
            self.hits["in_flight"] += 1
            return PromptAudio(False, fill.read())
        fill = self._fills[key.digest] = _Fill()
        try:
            source = await render()
        except BaseException as exc:
            del self._fills[key.digest]
            fill.opened.set_exception(exc)
            fill.opened.exception()  # retrieved: a refusal nobody else waited for is not an error to log
            raise
        self.misses += 1  # a render that runs (a refused one synthesised nothing)
        fill.opened.set_result(None)
        task = asyncio.get_running_loop().create_task(self._fill(key, fill, source), name=f"prompt-fill-{key.digest[:8]}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return PromptAudio(False, fill.read())

    async def _fill(self, key: PromptKey, fill: _Fill, source: AsyncIterator[np.ndarray]) -> None:
        try:
            async for pcm in source:
                fill.push(pcm)
        except BaseException as exc:
            del self._fills[key.digest]
            self.fill_failures += 1
            fill.end(CacheClosed("prompt cache closed") if isinstance(exc, asyncio.CancelledError) else exc)
            log.warning("prompt_fill_failed", key=key.digest[:12], error=repr(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                await aclose()
        samples = np.concatenate(fill.chunks) if fill.chunks else np.zeros(0, dtype=np.int16)
        self.store.remember(key, samples)
        del self._fills[key.digest]
        fill.end()
        log.info("prompt_cached", key=key.digest[:12], voice=key.voice, seconds=round(samples.size / key.rate, 2))
        await asyncio.to_thread(self.store.write, key, samples, key.rate)

    async def close(self) -> None:
        """Stop the fills still running (their listeners get CacheClosed)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
