"""Placement across engine workers (the gateway's side of several GPUs or hosts): each stream goes to the worker
with the most free slots, a full worker is skipped, a worker that goes away is skipped, and with none left the
refusal is the 503 kind; a worker fills to its last slot even while its heartbeats count streams it has not
opened yet. Real worker servers (engine_service) on loopback sockets, each with its own instant engine, and the
gateway's RemoteEngine client."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from engine_service import protocol
from engine_service.server import WORKER, WorkerSettings, make_app
from engines.base import EngineUnavailable, NoCapacity, SynthesisRequest
from engines.channel import ChunkChannel
from engines.instant import InstantEngine
from engines.remote import RemoteEngine, WorkerLink

TOKEN = "placement-token"


class HeldEngine(InstantEngine):
    """Admits its streams only when told, as a model engine does once its scheduler has a free row for them."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[ChunkChannel] = []

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        self.held.append(ChunkChannel(admitted=False))
        return self.held[-1]

    def admit_all(self) -> None:
        for channel in self.held:
            channel.admit()


class Worker:
    """One engine worker on a free loopback port; its streams stay open (the instant engine's first chunk waits)."""

    def __init__(self, slots: int, engine: InstantEngine | None = None) -> None:
        self.slots = slots
        self.engine = engine or InstantEngine(first_chunk_delay_ms=30_000)

    async def start(self) -> None:
        await self.engine.start()
        self.app = make_app(self.engine, WorkerSettings(token=TOKEN, slots=self.slots, status_interval_s=0.05))
        self.runner = web.AppRunner(self.app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.url = f"ws://{host}:{port}{protocol.STREAM_PATH}"

    @property
    def streams(self) -> int:
        return self.app[WORKER].streams_active

    async def stop(self) -> None:
        await self.runner.cleanup()
        await self.engine.close()


@pytest.fixture
async def two_workers():
    big, small = Worker(slots=3), Worker(slots=1)
    for worker in (big, small):
        await worker.start()
    client = RemoteEngine(urls=[big.url, small.url], token=TOKEN, engine_name="instant", dead_after_s=0.5)
    await client.start()
    await client.wait_ready(10)
    await asyncio.wait_for(_until(lambda: all(link.usable for link in client.links)), 10)
    yield client, big, small
    await client.close()
    for worker in (big, small):
        await worker.stop()


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.02)  # polling the client's view of the workers' heartbeats


async def _admit(client: RemoteEngine, index: int):
    free = client.health().slots_free
    stream = client.open_stream(SynthesisRequest(text=f"hello caller {index}", voice="en", call_id=f"c{index}"))
    await asyncio.wait_for(stream.admitted(), 5)
    assert client.health().slots_free == free - 1  # exact at once, whichever heartbeats came meanwhile
    return stream


async def test_streams_go_to_the_worker_with_the_most_free_slots_until_every_slot_is_taken(two_workers):
    client, big, small = two_workers
    assert client.health().slots_free == 4
    streams = [await _admit(client, 0), await _admit(client, 1)]
    assert (big.streams, small.streams) == (2, 0)  # 3 free against 1, then 2 against 1
    streams += [await _admit(client, 2), await _admit(client, 3)]  # 1 against 1: either; then the other
    assert (big.streams, small.streams) == (3, 1)
    assert not client.health().accepting
    with pytest.raises(NoCapacity):
        client.open_stream(SynthesisRequest(text="one too many", voice="en"))
    streams[0].cancel()  # a call ends: its slot is free again, on the worker that had it
    await asyncio.wait_for(_until(lambda: big.streams == 2 and client.health().slots_free == 1), 5)
    await _admit(client, 4)
    assert (big.streams, small.streams) == (3, 1)


async def test_a_worker_that_goes_away_is_skipped_and_with_none_left_calls_are_refused(two_workers):
    client, big, small = two_workers
    await big.stop()
    await asyncio.wait_for(_until(lambda: client.health().slots_total == 1), 5)
    await _admit(client, 0)
    assert small.streams == 1
    with pytest.raises(NoCapacity):  # the one worker left is full
        client.open_stream(SynthesisRequest(text="no room", voice="en"))
    await small.stop()
    await asyncio.wait_for(_until(lambda: client.health().state != "ready"), 5)
    with pytest.raises(EngineUnavailable):
        client.open_stream(SynthesisRequest(text="nobody home", voice="en"))


def _statuses(link: WorkerLink) -> asyncio.Queue[protocol.Status]:
    """Each status the client takes in from now on, in order, so a test can wait for the one it needs."""
    heard: asyncio.Queue[protocol.Status] = asyncio.Queue()
    take_in = link._on_control

    def take_in_and_tell(frame: protocol.Frame) -> None:
        take_in(frame)
        if isinstance(frame, protocol.Status):
            heard.put_nowait(frame)

    link._on_control = take_in_and_tell
    return heard


async def _heard_free(heard: asyncio.Queue[protocol.Status], slots_free: int) -> None:
    while (await heard.get()).slots_free != slots_free:
        pass


async def test_a_worker_fills_to_its_last_slot_while_its_heartbeats_count_streams_not_yet_opened():
    """No call gets a 503 a slot early: the worker counts a stream from its open, before it says opened (its engine
    may take a while to admit it), so a heartbeat between the two counts it already; the client must not subtract
    it again. Each open here goes out while the client holds such a heartbeat for every stream before it."""
    worker = Worker(slots=3, engine=HeldEngine())
    await worker.start()
    client = RemoteEngine(urls=[worker.url], token=TOKEN, engine_name="instant")
    await client.start()
    try:
        await client.wait_ready(10)
        heard = _statuses(client.links[0])
        streams = []
        for index in range(worker.slots):
            streams.append(client.open_stream(SynthesisRequest(text=f"caller {index}", voice="en")))
            await asyncio.wait_for(_heard_free(heard, worker.slots - 1 - index), 5)
        with pytest.raises(NoCapacity):
            client.open_stream(SynthesisRequest(text="one too many", voice="en"))
        worker.engine.admit_all()
        await asyncio.wait_for(asyncio.gather(*(stream.admitted() for stream in streams)), 5)
        assert worker.streams == worker.slots
        with pytest.raises(NoCapacity):
            client.open_stream(SynthesisRequest(text="still one too many", voice="en"))
    finally:
        await client.close()
        await worker.stop()
