"""Placement across engine workers (the gateway's side of several GPUs or hosts): each stream goes to the worker
with the most free slots, a full worker is skipped, a worker that goes away is skipped, and with none left the
refusal is the 503 kind; a worker fills to its last slot even while its heartbeats count streams it has not
opened yet; an open one worker refuses for room is placed on another, one refused for its text is not; a burst
while one worker is hung (SIGSTOP) is all taken by the other. Real worker servers (engine_service) on loopback
sockets, in this process or as `python -m engine_service` processes, each with its own instant engine, and the
gateway's RemoteEngine client."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from engine_service import protocol
from engine_service.server import WORKER, WorkerSettings, make_app
from engines.base import BadText, EngineUnavailable, NoCapacity, SynthesisRequest
from engines.channel import ChunkChannel
from engines.instant import InstantEngine
from engines.remote import RemoteEngine
from engines.worker_link import WorkerLink

TOKEN = "placement-token"
REPO = Path(__file__).resolve().parents[2]


class HeldEngine(InstantEngine):
    """Admits its streams only when told, as a model engine does once its scheduler has a free row for them."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[ChunkChannel] = []
        self.requests: list[SynthesisRequest] = []

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        self.requests.append(request)
        self.held.append(ChunkChannel(admitted=False))
        return self.held[-1]

    def admit_all(self) -> None:
        for channel in self.held:
            channel.admit()


class Worker:
    """One engine worker on a free loopback port; its streams stay open (the instant engine's first chunk waits)."""

    def __init__(self, slots: int, engine: InstantEngine | None = None, status_interval_s: float = 0.05) -> None:
        self.slots = slots
        self.engine = engine or InstantEngine(first_chunk_delay_ms=30_000)
        self.status_interval_s = status_interval_s

    async def start(self) -> None:
        await self.engine.start()
        self.app = make_app(self.engine, WorkerSettings(token=TOKEN, slots=self.slots,
                                                        status_interval_s=self.status_interval_s))
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


class TextRefusingEngine(InstantEngine):
    """Refuses every text as one its frontend cannot read: a refusal for the request, not for room."""

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        raise BadText(f"cannot read {request.text!r}")


async def test_an_open_one_worker_refuses_for_room_is_placed_on_the_other_and_one_refused_for_its_text_is_not():
    """Another gateway takes the busy worker's slots between two of its statuses, so this gateway still sees them
    free and opens there: the worker refuses (no_capacity) and the stream is opened on the other worker before
    the caller hears anything. A refusal for the text is the caller's answer (it would be refused anywhere)."""
    busy, other = Worker(slots=2, status_interval_s=5.0), Worker(slots=1)
    for worker in (busy, other):
        await worker.start()
    client = RemoteEngine(urls=[busy.url, other.url], token=TOKEN, engine_name="instant", dead_after_s=30)
    await client.start()
    try:
        await client.wait_ready(10)
        await asyncio.wait_for(_until(lambda: all(link.usable for link in client.links)), 10)
        assert [link.slots_free for link in client.links] == [2, 1]
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
            async with session.ws_connect(busy.url, params={"version": str(protocol.VERSION)}) as ws:
                for stream in (1, 2):  # the other gateway's two calls
                    await ws.send_str(protocol.serialize(protocol.Open(stream, "the other gateway", "en")))
                await asyncio.wait_for(_until(lambda: busy.streams == 2), 5)
                assert client.links[0].slots_free == 2  # no status since: this gateway still counts them free
                stream = client.open_stream(SynthesisRequest(text="moved along", voice="en", call_id="moved"))
                await asyncio.wait_for(stream.admitted(), 5)
                assert (busy.streams, other.streams) == (2, 1)
                assert stream.tried == {"remote-0", "remote-1"}
                stream.cancel()
    finally:
        await client.close()
        for worker in (busy, other):
            await worker.stop()

    picky, other = Worker(slots=2, engine=TextRefusingEngine()), Worker(slots=1)
    for worker in (picky, other):
        await worker.start()
    client = RemoteEngine(urls=[picky.url, other.url], token=TOKEN, engine_name="instant")
    await client.start()
    try:
        await asyncio.wait_for(_until(lambda: all(link.usable for link in client.links)), 10)
        stream = client.open_stream(SynthesisRequest(text="unreadable", voice="en"))
        with pytest.raises(BadText):
            await asyncio.wait_for(stream.admitted(), 5)
        assert other.streams == 0
    finally:
        await client.close()
        for worker in (picky, other):
            await worker.stop()


@asynccontextmanager
async def worker_process(slots: int, graphs: str = "compiled") -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`python -m engine_service` with an instant engine whose streams stay open (and whose health says its graphs
    are `graphs`); yields (process, link URL)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "engine_service", "--engine", "instant", "--slots", str(slots),
        "--settings", json.dumps({"first_chunk_delay_ms": 30_000, "graphs": graphs}), "--log-level", "warning",
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    try:
        line = await asyncio.wait_for(process.stdout.readline(), 60)
        yield process, json.loads(line)["url"]
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGCONT)
            process.terminate()
            await process.wait()


async def test_a_burst_while_one_worker_hangs_is_all_taken_by_the_other_and_the_hung_one_leaks_no_slot():
    """Issue #31: a worker SIGSTOPped is not declared dead for dead_after_s; meanwhile a burst of 16 streams must
    all be admitted by the worker that answers (before: 7 of 16 were placed on the hung one and refused)."""
    async with worker_process(64) as (hung, hung_url), worker_process(64) as (_, other_url):
        client = RemoteEngine(urls=[hung_url, other_url], engine_name="instant", dead_after_s=30)
        await client.start()
        try:
            await client.wait_ready(30)
            await asyncio.wait_for(_until(lambda: all(link.usable for link in client.links)), 30)
            hung_link = client.links[0]
            os.kill(hung.pid, signal.SIGSTOP)
            streams = [client.open_stream(SynthesisRequest(text=f"burst caller {i}", voice="en", call_id=f"b{i}"))
                       for i in range(16)]
            assert any(stream.link is hung_link for stream in streams)  # not yet late: some went there first
            await asyncio.wait_for(asyncio.gather(*(stream.admitted() for stream in streams)), 20)
            assert all(stream.link is client.links[1] for stream in streams)

            await asyncio.wait_for(_until(lambda: hung_link.late), 10)
            assert hung_link.usable  # not declared dead: late only
            stream = client.open_stream(SynthesisRequest(text="after the burst", voice="en"))
            assert stream.tried == {"remote-1"}  # placed around the late worker at once
            await asyncio.wait_for(stream.admitted(), 5)

            os.kill(hung.pid, signal.SIGCONT)  # it wakes, reads the moved opens and their cancels: no slot kept
            await asyncio.wait_for(_until(lambda: not hung_link.late and hung_link.slots_free == 64), 10)
        finally:
            await client.close()


async def test_a_stream_collected_whole_reaches_the_worker_s_engine_unpaced_and_a_live_one_paced():
    """SynthesisRequest.paced crosses the link (the open's `paced`, sent only when false): a prerender or file
    render is not paced by the worker's runtime, a live call still is."""
    worker = Worker(slots=2, engine=HeldEngine())
    await worker.start()
    client = RemoteEngine(urls=[worker.url], token=TOKEN, engine_name="instant")
    try:
        await client.start()
        await client.wait_ready(10)
        client.open_stream(SynthesisRequest(text="a file to download", voice="en", paced=False))
        client.open_stream(SynthesisRequest(text="a live call", voice="en"))
        await asyncio.wait_for(_until(lambda: len(worker.engine.requests) == 2), 10)
        assert {r.text: r.paced for r in worker.engine.requests} == {"a file to download": False, "a live call": True}
    finally:
        await client.close()
        await worker.stop()


@pytest.mark.parametrize(("graphs", "survives"), [("compiling", True), ("compiled", False)])
async def test_a_worker_that_stalls_while_compiling_keeps_its_calls_and_one_compiled_is_called_dead(graphs, survives):
    """A worker's Python stops for seconds in a full GC walk over the compiler's objects after ready (H200: 0.27 s
    warm, over 1 s cold): while its status says its graphs are compiling, 2 s of silence does not end its calls
    (COMPILING_DEAD_AFTER_S); at full speed the same silence is a dead worker (dead_after_s 1 s)."""
    async with worker_process(4, graphs) as (worker, url):
        client = RemoteEngine(urls=[url], engine_name="instant", dead_after_s=1.0)
        await client.start()
        try:
            await client.wait_ready(30)
            link = client.links[0]
            await asyncio.wait_for(_until(lambda: link.status is not None and link.status.graphs == graphs), 10)
            stream = client.open_stream(SynthesisRequest(text="a call through the stall", voice="en", call_id="s1"))
            await asyncio.wait_for(stream.admitted(), 10)
            os.kill(worker.pid, signal.SIGSTOP)
            await asyncio.sleep(2.0)
            os.kill(worker.pid, signal.SIGCONT)
            await asyncio.sleep(0.5)  # a status or two after it wakes
            lost = False
            try:  # its first chunk is 30 s away: a live stream has nothing to read yet, a lost one its failure
                await asyncio.wait_for(stream.__anext__(), 0.5)
            except asyncio.TimeoutError:
                pass
            except Exception:  # noqa: BLE001 - the link's loss, as the call sees it
                lost = True
            assert lost is not survives
            assert (link.slots_free == 3) is survives  # a live stream still holds its slot on the worker
        finally:
            await client.close()
