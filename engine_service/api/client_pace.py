"""Relaying a stream's audio to a client that may not keep up: the backlog is bounded in time, and so in bytes.

The engine never waits for a client (its channel never blocks, so one slow reader cannot stall the batch), so a
client that reads slower than synthesis leaves the difference here. `relay` moves the encoded audio from the
engine into a backlog and from it to the client; the client is cut (`SlowClient`) when one write waits longer
than `tts_api.slow_client_timeout_s`, or when the backlog stays above `tts_api.max_stream_buffer_bytes` for that
long. Then the stream is cancelled and its engine slot freed, instead of a slow reader holding it for as long
as it likes (a 2,000-character text read at 1.2 KB/s held one for ~1.5 h). One stream's backlog is at most the
bound plus what the engine makes in the timeout (and never more than its utterance). `StreamBuffers` holds the
counts the worker's metrics read.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass


class SlowClient(Exception):
    """The client did not take its audio in time; the stream must end."""


@dataclass
class StreamBuffers:
    buffered_bytes: int = 0  # audio made and not yet taken, over all streams now
    slow_clients: int = 0  # streams cut for a slow client


async def relay(audio: AsyncIterator[bytes], write: Callable[[bytes], Awaitable[None]], timeout_s: float,
                max_bytes: int, buffers: StreamBuffers) -> int:
    """Write every piece of `audio`; return the bytes written. Raises SlowClient, or what `audio` raises."""
    loop = asyncio.get_running_loop()
    backlog: deque[bytes] = deque()
    state = {"size": 0, "over_since": None}
    arrived = asyncio.Event()

    async def pull() -> None:
        async for data in audio:
            backlog.append(data)
            state["size"] += len(data)
            buffers.buffered_bytes += len(data)
            arrived.set()
            if state["size"] <= max_bytes:
                state["over_since"] = None
            elif state["over_since"] is None:
                state["over_since"] = loop.time()
            elif loop.time() - state["over_since"] > timeout_s:
                raise SlowClient(f"{state['size']} bytes waiting for over {timeout_s:g} s")

    puller = asyncio.create_task(pull(), name="tts-api-audio")
    sent = 0
    try:
        while True:
            if not backlog:
                if puller.done():
                    puller.result()  # the engine's failure, or the client was too slow
                    return sent
                arrived.clear()
                waiter = asyncio.ensure_future(arrived.wait())
                await asyncio.wait({waiter, puller}, return_when=asyncio.FIRST_COMPLETED)
                waiter.cancel()
                continue
            data = backlog.popleft()
            writing = asyncio.ensure_future(write(data))
            watched = {writing} if puller.done() else {writing, puller}
            done, _ = await asyncio.wait(watched, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if writing not in done and puller in done:
                if (failure := puller.exception()) is not None:  # the engine failed, or the backlog stayed over
                    await _cancelled(writing)
                    raise failure
                done, _ = await asyncio.wait({writing}, timeout=timeout_s)  # all made: this write may finish
            if writing not in done:
                await _cancelled(writing)
                raise SlowClient(f"a write of {len(data)} bytes waited over {timeout_s:g} s")
            writing.result()
            sent += len(data)
            state["size"] -= len(data)
            buffers.buffered_bytes -= len(data)
    finally:
        puller.cancel()
        await asyncio.gather(puller, return_exceptions=True)
        buffers.buffered_bytes -= state["size"]


async def _cancelled(task: asyncio.Future) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
