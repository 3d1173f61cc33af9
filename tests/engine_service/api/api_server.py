"""Helpers for the TTS API tests: a real aiohttp server on loopback around a real engine.

`GatedEngine` is a small engine of the real interface whose synthesis the test controls: it hands out its
first chunk at once and the rest only when the test opens the gate. With it a test proves, without timing,
that audio leaves before synthesis ends, that a disconnect or a clear cancels the engine's stream, and that a
503 comes instead of a stall.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import numpy as np
from aiohttp import web

from engine_service.api import TtsApiSettings, add_tts_routes
from engines.base import SAMPLE_RATE, SpeechEngine, SynthesisFailed, SynthesisRequest
from engines.channel import ChunkChannel
from engines.segmented import speak_segments

KEY = "test-key-0123456789abcdef"
OTHER_KEY = "other-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


def settings(**overrides) -> TtsApiSettings:
    block = {"api_keys": [{"name": "test", "key": KEY, "max_streams": 4},
                          {"name": "other", "key": OTHER_KEY, "max_streams": 1}]}
    block.update(overrides)
    return TtsApiSettings.from_mapping(block)


@dataclass
class Server:
    url: str
    ws_url: str
    app: web.Application


@asynccontextmanager
async def serve(engine: SpeechEngine, api_settings: TtsApiSettings | None = None) -> AsyncIterator[Server]:
    app = web.Application()
    add_tts_routes(app, engine, api_settings or settings())
    async with _serving(app) as server:
        yield server


@asynccontextmanager
async def serve_app(app: web.Application) -> AsyncIterator[str]:
    async with _serving(app) as server:
        yield server.url


@asynccontextmanager
async def _serving(app: web.Application) -> AsyncIterator[Server]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    try:
        yield Server(f"http://{host}:{port}", f"ws://{host}:{port}", app)
    finally:
        await runner.cleanup()


class GatedEngine(SpeechEngine):
    """First chunk at once, the rest (`chunks` in all, 100 ms each) once `gate` is set (one chunk: no wait).

    Stream n (from 1) is a constant level of n / 10 (`level_of`), so a test can tell whose audio it got."""

    name = "gated"

    def __init__(self, chunks: int = 5, admit: bool = True, fail_after_first: bool = False) -> None:
        self.gate = asyncio.Event()
        self.channels: list[ChunkChannel] = []
        self.texts: list[str] = []
        self.paced: list[bool] = []  # each stream's SynthesisRequest.paced
        self._chunks = chunks
        self._admit = admit
        self._fail_after_first = fail_after_first

    def voices(self) -> Sequence[str]:
        return ("en", "zh")

    @property
    def default_voice(self) -> str:
        return "en"

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        if request.segments:
            return speak_segments(self, request)
        channel = ChunkChannel(admitted=self._admit)
        self.channels.append(channel)
        self.texts.append(request.text)
        self.paced.append(request.paced)
        if self._admit:
            asyncio.get_running_loop().create_task(self._produce(channel, len(self.channels) / 10))
        return channel  # not admitted: the engine never answers (a hung worker)

    async def _produce(self, channel: ChunkChannel, level: float) -> None:
        chunk = np.full(SAMPLE_RATE // 10, level, dtype=np.float32)
        channel.put(chunk)
        if self._chunks > 1 or self._fail_after_first:
            await self.gate.wait()
        if self._fail_after_first:
            channel.fail(SynthesisFailed("gated engine told to fail"))
            return
        for _ in range(self._chunks - 1):
            channel.put(chunk)
        channel.finish()

    @staticmethod
    def level_of(stream_number: int) -> int:
        """The int16 value stream `stream_number` (from 1) decodes to."""
        return round(stream_number / 10 * 32768)

    @property
    def samples_per_stream(self) -> int:
        return self._chunks * (SAMPLE_RATE // 10)


async def until(predicate, timeout_s: float = 5.0) -> None:
    """Wait for server-side state a client cannot see an event for (a slot released after a disconnect)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
