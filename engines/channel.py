"""ChunkChannel: the hand-off of audio chunks from a synthesis thread to an asyncio consumer.

The producer (a worker thread, or the GPU scheduler's thread) calls `put`, `finish` or `fail`; these
are thread-safe and never block. The consumer iterates with `async for chunk in channel` on the loop
that created the channel and may `cancel()` at any time; the producer sees `cancelled` and stops.
Chunks are float32 mono numpy arrays at the engine's sample rate.

Admission: an in-process engine knows at once whether it takes a stream, so its channels start admitted. An
engine that must ask elsewhere (a worker process) makes the channel with `admitted=False` and later calls
`admit()` or `refuse(error)`; the consumer awaits `admitted()` before it answers the call, so a refusal is a SIP
rejection and never an answered call left silent.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import numpy as np

_END = object()


class ChunkChannel(AsyncIterator[np.ndarray]):
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None, admitted: bool = True) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._queue: asyncio.Queue[object] = asyncio.Queue()
        self._admission: asyncio.Future[None] = self._loop.create_future()
        if admitted:
            self._admission.set_result(None)
        self._cancel = threading.Event()
        self._closed = False
        self.opened_at = time.monotonic()
        self.first_chunk_at: float | None = None
        self.outcome: str | None = None  # as the consumer saw it: "completed" (the end read) or "failed"

    # -- producer side (any thread) -------------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def put(self, chunk: np.ndarray) -> None:
        if self._cancel.is_set():
            return
        self._post(np.ascontiguousarray(chunk, dtype=np.float32).reshape(-1))

    def finish(self) -> None:
        self._post(_END)

    def fail(self, error: BaseException) -> None:
        self._post(error)

    def admit(self) -> None:
        self._post_admission(None)

    def refuse(self, error: BaseException) -> None:
        """Before any chunk: the stream will not run (no capacity, unknown voice...)."""
        self._post_admission(error)

    def _post_admission(self, error: BaseException | None) -> None:
        def settle() -> None:
            if self._admission.done():
                return
            if error is None:
                self._admission.set_result(None)
            else:
                self._admission.set_exception(error)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            self._cancel.set()

    def _post(self, item: object) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # loop closed: the consumer is gone, nothing to deliver to
            self._cancel.set()

    # -- consumer side (the event loop) ----------------------------------------------------------
    async def admitted(self) -> None:
        """Return once the engine took the stream; raise its refusal (a SynthesisRefused) otherwise."""
        await asyncio.shield(self._admission)

    def cancel(self) -> None:
        self._cancel.set()
        self._closed = True
        if not self._admission.done():
            self._admission.cancel()

    def __aiter__(self) -> ChunkChannel:
        return self

    async def __anext__(self) -> np.ndarray:
        if self._closed:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _END:
            self._closed, self.outcome = True, "completed"
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._closed, self.outcome = True, "failed"
            raise item
        if self.first_chunk_at is None:
            self.first_chunk_at = time.monotonic()
        return item  # type: ignore[return-value]
