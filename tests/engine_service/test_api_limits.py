"""The speech API's limits on a worker (issue 31, items 7 and 9): reserved call slots, slow readers, hostile JSON
and key guessing, each with a real aiohttp client (or a raw socket for the slow reader) against the worker's app
on a loopback socket, and a gateway link beside it where calls matter."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from engine_service import protocol
from engine_service.api.settings import TtsApiSettings
from engine_service.server import WorkerSettings, make_app
from engines.instant import InstantEngine
from tests.engine_service.worker_link import TOKEN, connect, frame_is, serving

pytestmark = pytest.mark.timeout(90)

KEY = "api-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


def api_settings(**overrides) -> TtsApiSettings:
    return TtsApiSettings.from_mapping({"api_keys": [{"name": "bot", "key": KEY, "max_streams": 8}], **overrides})


async def _metric(session: aiohttp.ClientSession, base: str, line_start: str) -> float:
    async with session.get(f"{base}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start))


async def test_api_streams_cannot_take_the_slots_reserved_for_calls():
    engine = InstantEngine(chunk_ms=100, ms_per_char=20.0, max_duration_s=30.0, first_chunk_delay_ms=1500)
    await engine.start()
    try:
        async with serving(engine, WorkerSettings(token=TOKEN, slots=3, status_interval_s=0.05),
                           api_settings(reserved_call_slots=1)) as base, aiohttp.ClientSession() as session:
            async def speak() -> int:
                async with session.post(f"{base}/v1/tts", headers=AUTH, json={"text": "held a while"}) as response:
                    await response.read()
                    return response.status

            held = [asyncio.create_task(speak()) for _ in range(2)]
            link = await connect(session, base)
            await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 1)
            async with session.post(f"{base}/v1/tts", headers=AUTH, json={"text": "one more"}) as third:
                assert third.status == 503 and "Retry-After" in third.headers
                body = await third.json()
                assert body["error"] == "at_capacity" and "kept for calls" in body["message"]
            await link.send(protocol.Open(stream=1, text="a call still gets in", voice="en", call_id="c1"))
            await link.until(frame_is(protocol.End, 1))
            assert link.of(1, protocol.Opened)
            assert await asyncio.gather(*held) == [200, 200]
            await link.ws.close()
    finally:
        await engine.close()


def test_reserving_every_slot_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="tts_api.reserved_call_slots: 3 leaves the speech API none"):
        make_app(InstantEngine(), WorkerSettings(slots=3), api_settings(reserved_call_slots=3))


async def test_a_slow_reader_is_cut_its_slot_freed_and_its_backlog_bounded():
    # realtime: audio comes at the pace of a streaming model, as from the GPU, so the backlog grows as it would
    engine = InstantEngine(chunk_ms=100, ms_per_char=60.0, max_duration_s=120.0, realtime=True)
    await engine.start()
    bound, timeout_s = 65536, 1.0
    try:
        async with _small_send_buffer_worker(engine, api_settings(slow_client_timeout_s=timeout_s,
                                                                  max_stream_buffer_bytes=bound)) as base, \
                aiohttp.ClientSession() as session:
            host, port = base.removeprefix("http://").rsplit(":", 1)
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, as a slow link has
            reader.connect((host, int(port)))
            body = ('{"text": "' + "Speak slowly to a reader who barely listens. " * 44 + '"}').encode()
            reader.sendall(f"POST /v1/tts HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                           f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            reader.setblocking(False)
            loop = asyncio.get_running_loop()
            peak, cut = 0.0, False
            for _ in range(300):  # read 120 bytes every 0.1 s (1.2 KB/s, as the reader), for at most 30 s
                peak = max(peak, await _metric(session, base, "tts_api_stream_buffered_bytes"))
                if await _metric(session, base, "tts_api_slow_clients_total") == 1:
                    cut = True
                    break
                with contextlib.suppress(TimeoutError, ConnectionResetError):
                    await asyncio.wait_for(loop.sock_recv(reader, 120), 0.1)
                await asyncio.sleep(0.1)
            reader.close()
            assert cut, "the slow reader was never cut"
            # the bound plus what a real-time engine makes in the timeout (48 kB/s) and one chunk: not the 5.7 MB
            assert peak <= bound + 48000 * (timeout_s + 0.5) + 4800
            link = await connect(session, base)  # the slot is free again
            await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 2)
            await link.ws.close()
    finally:
        await engine.close()


@asynccontextmanager
async def _small_send_buffer_worker(engine, tts_api: TtsApiSettings) -> AsyncIterator[str]:
    """The worker's app on a listening socket whose connections get a small kernel send buffer (accepted sockets
    inherit it), so a reader's slowness reaches the worker in seconds instead of after the kernel's 4 MB."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16384)
    listener.bind(("127.0.0.1", 0))
    runner = web.AppRunner(make_app(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05), tts_api))
    await runner.setup()
    await web.SockSite(runner, listener).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("body", "words"), [
    ("[" * 100_000 + "]" * 100_000, "nests"),
    ('{"text": "hi", "x": ' + "[" * 20 + "]" * 20 + "}", "nests"),
    ('{"text": "hi", "sample_rate": ' + "9" * 5000 + "}", "5000 characters"),
])
async def test_hostile_json_is_a_400_naming_the_problem(body, words):
    engine = InstantEngine()
    await engine.start()
    try:
        async with serving(engine, WorkerSettings(token=TOKEN), api_settings()) as base, \
                aiohttp.ClientSession() as session:
            async with session.post(f"{base}/v1/tts", headers={**AUTH, "Content-Type": "application/json"},
                                    data=body) as response:
                assert response.status == 400
                error = await response.json()
                assert error["error"] == "bad_json" and words in error["message"]
            async with session.post(f"{base}/v1/tts", headers=AUTH, json={"text": "still fine"}) as response:
                assert response.status == 200 and len(await response.read()) > 0
    finally:
        await engine.close()


async def test_wrong_keys_are_logged_once_and_limited_per_source():
    engine = InstantEngine()
    await engine.start()
    try:
        async with serving(engine, WorkerSettings(token=TOKEN), api_settings(max_key_failures=5)) as base, \
                aiohttp.ClientSession() as session:
            with capture_logs() as logs:
                for guess in range(5):
                    async with session.get(f"{base}/v1/voices",
                                           headers={"Authorization": f"Bearer guess-{guess:020d}"}) as response:
                        assert response.status == 401
                for _ in range(3):  # past the limit: 429, the key not even checked (the right one included)
                    async with session.get(f"{base}/v1/voices", headers=AUTH) as response:
                        assert response.status == 429 and int(response.headers["Retry-After"]) >= 1
                        assert (await response.json())["error"] == "too_many_failed_keys"
            refused = [entry for entry in logs if entry["event"] == "tts_api_key_refused"]
            assert len(refused) == 1 and refused[0]["source"] == "127.0.0.1"
            assert not any("guess-" in str(entry) for entry in logs)  # never the key itself
            assert await _metric(session, base, 'tts_api_key_failures_total{action="refused"}') == 5
            assert await _metric(session, base, 'tts_api_key_failures_total{action="limited"}') == 3
    finally:
        await engine.close()
