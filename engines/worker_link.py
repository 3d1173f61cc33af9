"""WorkerLink: the gateway's connection to one engine worker (engine_service) and the streams it runs there.

Each worker is one `WorkerLink`: one WebSocket, reconnected with backoff, read by one task. Workers push status
every ~250 ms; `dead_after_s` (1 s) of silence (5 s while the worker says its graphs are compiling:
COMPILING_DEAD_AFTER_S), or the socket closing (a worker killed), ends every stream on that link at once:
admitted ones fail (the call gets its BYE), waiting ones are placed again or refused (503). Streams on other
links are not touched. Everything here runs on the gateway's event loop and never blocks it: audio frames are
decoded with numpy and put on the stream's channel.

Free slots are exact for this gateway's own streams: a worker's last status less the opens sent on the link that
the worker had not handled when it built that status (the status says how many it had: `opens_seen`). An open
the worker has handled is in its count from then on, even before its `opened` (the engine may take a while to
admit it), so subtracting opens not yet answered would count it twice and refuse a call a slot early. Slots
that free up, or that other gateways take, show at the next status (~250 ms).

Placement (which worker gets an open, and where a refused one goes next) is RemoteEngine's
(engines/remote.py); a link only reports: `place_again` for an open refused for room or availability or lost
before `opened`, `place_unseen` for one its worker has not read after one late interval, `on_streams_lost`
when the link dies.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
import structlog

from engine_service import protocol
from engines.base import (SAMPLE_RATE, EngineUnavailable, NoCapacity, SynthesisFailed, SynthesisRefused,
                          SynthesisRequest)
from engines.channel import ChunkChannel
from engines.ssml.segments import to_wire

log = structlog.get_logger(__name__)

_MAX_RECONNECT_S = 5.0
LATE_FACTOR = 1.5  # a worker's status this many of its usual intervals old is late: place around it
# While a worker says its graphs are compiling (after ready, on a GPU), a full walk of the cyclic GC over the
# compiler's objects stops its Python, heartbeat included: 0.27 s in a warm start-up, over 1 s in cold ones on an
# H200 (engine_service/stall_watch.py). Such a worker is called dead only after this much silence, so the calls on
# it live through a stall (they are behind by as long; the playout holds ~1 s), while a worker killed is still
# seen at once (its socket closes).
COMPILING_DEAD_AFTER_S = 5.0


class RemoteChannel(ChunkChannel):
    """A stream served by a worker: cancelling it tells the worker, so its slot frees at once. Until it is
    admitted it keeps its request and the workers it tried, so it can be placed again elsewhere."""

    def __init__(self, request: SynthesisRequest) -> None:
        super().__init__(admitted=False)
        self.request = request
        self.tried: set[str] = set()  # worker names
        self.link: WorkerLink | None = None
        self.stream = 0

    def cancel(self) -> None:
        if not self.cancelled and self.link is not None:
            self.link.cancel(self.stream)
        super().cancel()


@dataclass
class _Stream:
    channel: RemoteChannel
    format: protocol.Format
    sent: int  # the link's opens sent, this one included: the worker has seen it once status.opens_seen >= sent
    admitted: bool = False


# An open that did not become a stream on its worker, and why: the engine places it again or refuses it.
PlaceAgain = Callable[[RemoteChannel, SynthesisRefused], None]


class WorkerLink:
    """One worker: its socket, what it last said (hello, status) and the streams this gateway runs there."""

    def __init__(self, name: str, url: str | None, token: str, dead_after_s: float,
                 session_of: Callable[[], aiohttp.ClientSession],
                 on_streams_lost: Callable[[str, int], None], place_again: PlaceAgain,
                 place_unseen: Callable[[RemoteChannel], None]) -> None:
        self.name = name
        self.url = url
        self._token = token
        self._dead_after_s = dead_after_s
        self._session_of = session_of
        self._on_streams_lost = on_streams_lost
        self._place_again = place_again
        self._place_unseen = place_unseen
        self._status_at: float | None = None  # when the last status came (monotonic)
        self._status_gap_s: float | None = None  # the usual time between statuses, measured on this link
        self.hello: protocol.Hello | None = None
        self.status: protocol.Status | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._outbox: asyncio.Queue[str] = asyncio.Queue()
        self._streams: dict[int, _Stream] = {}
        self._opens_sent = 0  # on this connection, as the worker's status.opens_seen counts them
        self._ids = itertools.count(1)
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._log = log.bind(worker=name)

    # -- what the engine asks --------------------------------------------------------------------
    @property
    def usable(self) -> bool:
        return self._ws is not None and self.hello is not None and self.status is not None \
            and self.status.state == "ready"

    @property
    def slots_free(self) -> int:
        """The last status's free slots less the opens it had not seen (see the module docstring)."""
        if self.status is None:
            return 0
        return max(self.status.slots_free - (self._opens_sent - self.status.opens_seen), 0)

    @property
    def first_audio_ms(self) -> float:
        return self.status.first_audio_ms if self.status else 0.0

    @property
    def late_after_s(self) -> float:
        # before two statuses, the heartbeat workers are built with: ~4 per dead_after_s (0.25 s of 1 s)
        return LATE_FACTOR * (self._status_gap_s if self._status_gap_s is not None else self._dead_after_s / 4)

    @property
    def silence_allowed_s(self) -> float:
        """How long the worker may be silent before it is called dead: `dead_after_s`, longer while its last status
        said its graphs are compiling (COMPILING_DEAD_AFTER_S)."""
        if self.status is not None and self.status.graphs == "compiling":
            return max(self._dead_after_s, COMPILING_DEAD_AFTER_S)
        return self._dead_after_s

    @property
    def late(self) -> bool:
        """No status for LATE_FACTOR usual intervals: hung or stalled, though not yet declared dead."""
        return self._status_at is not None and time.monotonic() - self._status_at > self.late_after_s

    def open(self, channel: RemoteChannel, fmt: protocol.Format) -> None:
        assert self._ws is not None
        stream = next(self._ids)
        channel.link, channel.stream = self, stream
        channel.tried.add(self.name)
        self._opens_sent += 1
        self._streams[stream] = _Stream(channel, fmt, sent=self._opens_sent)
        request = channel.request
        self._send(protocol.Open(stream=stream, text=request.text, voice=request.voice, call_id=request.call_id,
                                 options=dict(request.options), sample_rate=SAMPLE_RATE, format=fmt,
                                 segments=to_wire(request.segments), paced=request.paced))
        asyncio.get_running_loop().call_later(self.late_after_s, self._check_seen, stream)

    def _check_seen(self, stream: int) -> None:
        """One late interval after an open: a worker that has not even read it (no status counts it) is late,
        so the engine may move it to a worker that answers."""
        entry = self._streams.get(stream)
        if entry is None or entry.admitted or (self.status is not None and self.status.opens_seen >= entry.sent):
            return
        self._place_unseen(entry.channel)

    def cancel(self, stream: int) -> None:
        if self._streams.pop(stream, None) is not None and self._ws is not None:
            self._send(protocol.Cancel(stream))

    def _send(self, frame: protocol.Frame) -> None:
        if self._ws is not None:
            self._outbox.put_nowait(protocol.serialize(frame))

    async def _write(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """The link's one writer, so frames leave in the order they were made (open before its cancel)."""
        while True:
            await ws.send_str(await self._outbox.get())

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"engine-link-{self.name}")

    def retarget(self, url: str) -> None:
        """A (re)started worker listens, on a new port unless engine.worker.port fixes it: connect there now."""
        self.url = url
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        self._lose_streams("engine closed")

    async def _run(self) -> None:
        backoff = 0.25
        while True:
            if self.url is not None:
                try:
                    await self._connect_and_read()
                    backoff = 0.25
                except (aiohttp.ClientError, OSError, asyncio.TimeoutError, protocol.ProtocolError) as exc:
                    self._log.warning("engine_worker_unreachable", url=self.url, error=repr(exc))
                finally:
                    self._ws, self.hello, self.status, self._status_at = None, None, None, None
                    self._lose_streams("engine worker lost")
            self._wake.clear()
            try:  # a period between tries, cut short when the supervisor gives a new address
                await asyncio.wait_for(self._wake.wait(), backoff if self.url is not None else None)
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, _MAX_RECONNECT_S)

    async def _connect_and_read(self) -> None:
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        ws = await asyncio.wait_for(self._session_of().ws_connect(
            self.url, params={"version": str(protocol.VERSION), "graphs": "1"}, headers=headers, autoping=True,
            max_msg_size=1 << 22), timeout=5.0)
        self._outbox, self._opens_sent = asyncio.Queue(), 0  # a new link: the worker counts its opens from 0
        writer = asyncio.get_running_loop().create_task(self._write(ws), name=f"engine-link-writer-{self.name}")
        try:
            self._ws = ws
            self._log.info("engine_worker_connected", url=self.url)
            await self._read(ws)
        finally:
            writer.cancel()
            await asyncio.gather(writer, return_exceptions=True)
            await ws.close()

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while True:
            silence_s = self.silence_allowed_s
            try:
                message = await ws.receive(timeout=silence_s)
            except asyncio.TimeoutError:
                self._log.error("engine_worker_silent", silent_s=silence_s, streams=len(self._streams),
                                graphs=self.status.graphs if self.status is not None else None)
                return
            if message.type == aiohttp.WSMsgType.BINARY:
                self._on_audio(message.data)
            elif message.type == aiohttp.WSMsgType.TEXT:
                self._on_control(protocol.parse(message.data))
            else:  # closed, closing or an error: the worker is gone
                self._log.error("engine_worker_disconnected", streams=len(self._streams), close_code=ws.close_code)
                return

    def _on_audio(self, data: bytes) -> None:
        stream, samples = protocol.decode_audio(data, {k: s.format for k, s in self._streams.items()})
        entry = self._streams.get(stream)
        if entry is not None and samples.size:
            entry.channel.put(samples)

    def _on_control(self, frame: protocol.Frame) -> None:
        if isinstance(frame, protocol.Status):
            now = time.monotonic()
            if self._status_at is not None:  # a stall counts at most as dead_after_s, so it cannot hide lateness long
                gap = min(now - self._status_at, self._dead_after_s)
                self._status_gap_s = gap if self._status_gap_s is None else self._status_gap_s + 0.2 * (
                    gap - self._status_gap_s)
            self.status, self._status_at = frame, now
        elif isinstance(frame, protocol.Hello):
            if frame.version != protocol.VERSION:
                raise protocol.ProtocolError(f"worker speaks protocol {frame.version}, we speak {protocol.VERSION}")
            self.hello = frame
        elif isinstance(frame, protocol.Error):
            self._log.error("engine_worker_error", stream=frame.stream, message=frame.message)
            if frame.stream is not None and (entry := self._streams.pop(frame.stream, None)) is not None:
                self._end(entry, f"worker: {frame.message}")
        elif isinstance(frame, protocol.Opened | protocol.Refused | protocol.End | protocol.Failed):
            entry = self._streams.get(frame.stream)
            if entry is None:  # cancelled here meanwhile
                return
            if isinstance(frame, protocol.Opened):
                entry.admitted = True
                entry.channel.admit()
                return
            del self._streams[frame.stream]
            if isinstance(frame, protocol.Refused):
                self._unplaced(entry, protocol.refusal_error(frame))
            elif isinstance(frame, protocol.End):
                entry.channel.finish()
            else:
                entry.channel.fail(SynthesisFailed(f"engine worker {self.name}: {frame.message}"))

    def _end(self, entry: _Stream, why: str) -> None:
        if entry.admitted:
            entry.channel.fail(SynthesisFailed(why))
        else:
            self._unplaced(entry, EngineUnavailable(why))

    def _unplaced(self, entry: _Stream, refusal: SynthesisRefused) -> None:
        """Not admitted here: a refusal for room or availability may be placed again; one for the request stands."""
        if isinstance(refusal, NoCapacity | EngineUnavailable):
            self._place_again(entry.channel, refusal)
        else:
            entry.channel.refuse(refusal)

    def _lose_streams(self, why: str) -> None:
        streams, self._streams = self._streams, {}
        for entry in streams.values():
            self._end(entry, f"{why} ({self.name})")
        if streams:
            self._on_streams_lost(self.name, len(streams))
