"""Helpers for the worker's tests: a worker served on a real loopback socket, and the test's side of one link."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import numpy as np
from aiohttp import web

from engine_service import protocol
from engine_service.api.settings import TtsApiSettings
from engine_service.server import WorkerSettings, make_app
from engines.base import SpeechEngine

TOKEN = "s3cret"


@asynccontextmanager
async def serving(engine: SpeechEngine, settings: WorkerSettings, tts_api: TtsApiSettings | None = None
                  ) -> AsyncIterator[str]:
    """The worker's app around a started engine, on 127.0.0.1; yields its base URL (http://host:port)."""
    runner = web.AppRunner(make_app(engine, settings, tts_api))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class Link:
    """The test's side of one link: frames by stream, audio by stream."""

    def __init__(self, ws):
        self.ws = ws
        self.frames: list = []
        self.audio: dict[int, list[np.ndarray]] = {}
        self.formats: dict[int, str] = {}

    async def send(self, frame) -> None:
        if isinstance(frame, protocol.Open):
            self.formats[frame.stream] = frame.format
        await self.ws.send_str(protocol.serialize(frame) if not isinstance(frame, str) else frame)

    async def until(self, predicate, timeout: float = 10.0):
        async def read():
            while True:
                for frame in self.frames:
                    if predicate(frame):
                        return frame
                message = await self.ws.receive()
                if message.type == aiohttp.WSMsgType.BINARY:
                    stream, samples = protocol.decode_audio(message.data, self.formats)
                    self.audio.setdefault(stream, []).append(samples)
                elif message.type == aiohttp.WSMsgType.TEXT:
                    self.frames.append(protocol.parse(message.data))
                else:
                    raise ConnectionError(f"link closed: {message.type}")
        return await asyncio.wait_for(read(), timeout)

    def of(self, stream: int, kind: type) -> list:
        return [f for f in self.frames if isinstance(f, kind) and f.stream == stream]


async def connect(session: aiohttp.ClientSession, base: str) -> Link:
    ws = await session.ws_connect(f"{base}{protocol.STREAM_PATH}", params={"version": str(protocol.VERSION)},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
    return Link(ws)


def frame_is(kind, stream=None):
    return lambda f: isinstance(f, kind) and (stream is None or f.stream == stream)
