"""The engine worker's aiohttp app: one engine served to gateways over the streaming protocol (engine_service.protocol).

Routes: `GET /v1/engine/stream` (the WebSocket link, token and version checked before the upgrade),
`GET /v1/status` (the same figures as the status frame, token checked), `GET /healthz` (200 while the engine is
ready, 503 otherwise, no token: for load balancers) and `GET /metrics` (Prometheus, no token; engine_service.metrics).
`make_app` returns a plain `web.Application`, so other route sets (the public TTS API) can be added to the same server.
`start_listener` serves it with caps (engine.worker.max_connections, ...: connection_caps), keeping a reserve of
connections for the gateways' links (engine.worker.link_reserve), so a flood of idle connections never locks them out.

What this module must never do: block the engine. Engine threads hand chunks to a `ChunkChannel` (never blocks);
one task per stream moves them into the link's outbox and one writer task per link sends it. A gateway that
stops reading only fills its own link's outbox: past `max_outbox_bytes`, or when it stops answering WebSocket
pings for `heartbeat_s`, the link is closed and its streams cancelled, which frees their slots.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import time
from dataclasses import asdict, dataclass, field
from types import MappingProxyType

import structlog
from aiohttp import WSMsgType, web
from prometheus_client import CONTENT_TYPE_LATEST

from connection_caps.budget import ConnectionCaps, DescriptorBudget
from connection_caps.listener import CappedSite, HttpLimits, ListenerGuard, ListenerMetrics, quiet_accept_errors
from engine_service import protocol
from engine_service.api.context import TTS_API
from engine_service.api.routes import add_tts_routes
from engine_service.api.settings import TtsApiSettings
from engine_service.first_audio import FirstAudioEstimate
from engine_service.metrics import WorkerMetrics
from engines.base import SpeechEngine, SynthesisFailed, SynthesisRefused, SynthesisRequest
from engines.ssml.segments import from_wire

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WorkerSettings:
    token: str = ""  # empty: no token asked (only sensible on loopback)
    slots: int = 64  # streams served at once; more are refused with no_capacity
    status_interval_s: float = 0.25  # the heartbeat a gateway watches (it calls a worker dead after ~1 s of silence)
    heartbeat_s: float = 2.0  # WebSocket ping; a gateway that does not answer is dropped
    max_outbox_bytes: int = 64 * 2**20  # audio queued for a gateway that does not read; beyond, the link is dropped


@dataclass
class EngineWorker:
    """The one engine and what is shared by all links: slots in use and the first-audio estimate."""

    engine: SpeechEngine
    settings: WorkerSettings
    streams_active: int = 0
    estimate: FirstAudioEstimate = field(default_factory=FirstAudioEstimate)
    metrics: WorkerMetrics = field(init=False)
    _keys: itertools.count = field(default_factory=itertools.count)

    def __post_init__(self) -> None:
        self.metrics = WorkerMetrics(self)

    def status(self, opens_seen: int = 0, graphs: bool = True) -> protocol.Status:
        """How things are now; `opens_seen` comes from the link the status goes to (it is per link), `graphs`
        whether that link asked for the graphs' state (an older gateway refuses the field)."""
        health = self.engine.health()
        free = self.settings.slots - self.streams_active
        if health.slots_free is not None:
            free = min(free, health.slots_free)
        return protocol.Status(state=health.state, slots_total=self.settings.slots, slots_free=max(free, 0),
                               queue_depth=self.estimate.waiting,
                               first_audio_ms=round(self.estimate.expected_s(time.monotonic()) * 1000, 1),
                               opens_seen=opens_seen, graphs=health.graphs if graphs else None)

    def hello(self) -> protocol.Hello:
        engine = self.engine
        return protocol.Hello(version=protocol.VERSION, engine=engine.name, voices=tuple(engine.voices()),
                              default_voice=engine.default_voice, sample_rate=engine.sample_rate,
                              max_text_chars=engine.max_text_chars)

    def next_key(self) -> int:
        return next(self._keys)

    # The speech API's streams take the same slots as the gateways' (engine_service.api.context.SharedSlots),
    # so the free count every gateway sees includes them.
    def take(self, keep_free: int = 0) -> bool:
        if self.streams_active >= self.settings.slots - keep_free:
            return False
        self.streams_active += 1
        return True

    def give_back(self) -> None:
        self.streams_active -= 1


_STATUS_DUE = ""  # a placeholder in the outbox: the status is built when the writer reaches it

WORKER = web.AppKey("engine_worker", EngineWorker)


def make_app(engine: SpeechEngine, settings: WorkerSettings, tts_api: TtsApiSettings | None = None
             ) -> web.Application:
    """The worker's routes around an engine that is already started (its owner closes it); with `tts_api`,
    the speech API's routes too (engine_service/api), sharing the worker's slots."""
    worker = EngineWorker(engine, settings)
    app = web.Application(middlewares=[worker.metrics.middleware()])
    app[WORKER] = worker
    if tts_api is not None:
        if tts_api.reserved_call_slots >= settings.slots:
            raise ValueError(f"tts_api.reserved_call_slots: {tts_api.reserved_call_slots} leaves the speech API "
                             f"none of this worker's {settings.slots} slots")
        add_tts_routes(app, engine, tts_api, shared_slots=worker)
        worker.metrics.watch_api(app[TTS_API])
        worker.metrics.watch_prompt_cache(app[TTS_API].prompt_cache)
    app.router.add_get(protocol.STREAM_PATH, _stream_endpoint)
    app.router.add_get("/v1/status", _status_endpoint)
    app.router.add_get("/healthz", _healthz)
    app.router.add_get("/metrics", _metrics)
    return app


async def start_listener(runner: web.AppRunner, host: str, port: int, limits: HttpLimits, link_reserve: int
                         ) -> None:
    """Serve `runner` (set up with `runner_options(limits)`) on host:port with the worker's caps. Past them, up to
    `link_reserve` connections are admitted on probation and kept only if their request head carries the
    engine token: a gateway's link gets in while strangers hold every other connection."""
    worker = runner.app[WORKER]
    metrics = worker.metrics
    quiet_accept_errors(asyncio.get_running_loop(), metrics.accept_errors)
    # The budget keeps descriptors back for the engine (model files, threads, pipes): accepts never hit EMFILE.
    caps = ConnectionCaps(limits.max_connections, limits.max_connections_per_source, link_reserve,
                          DescriptorBudget.from_rlimit(reserved=0))
    guard = ListenerGuard(caps,
                          limits, ListenerMetrics(metrics.http_refused, metrics.http_closed, metrics.http_open),
                          trusted=_link_head(worker.settings.token))
    await CappedSite(runner, host, port, guard).start()


def _link_head(token: str):
    """Whether a request head (bytes up to the blank line) is a gateway's link: the stream path and, when the
    worker has a token, the token. The head is read before aiohttp parses it, so this is a byte-level check."""
    expected = f"Bearer {token}".encode()
    path = f" {protocol.STREAM_PATH}".encode()

    def trusted(head: bytes) -> bool:
        request_line, *lines = head.split(b"\r\n")
        if path not in request_line:
            return False
        if not token:
            return True
        for line in lines:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"authorization" and hmac.compare_digest(value.strip(), expected):
                return True
        return False

    return trusted


def _authorized(request: web.Request, token: str) -> bool:
    if not token:
        return True
    offered = request.headers.get("Authorization", "")
    return hmac.compare_digest(offered.encode(), f"Bearer {token}".encode())


def _unauthorized() -> web.Response:
    return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                             headers={"WWW-Authenticate": 'Bearer realm="engine"'})


async def _healthz(request: web.Request) -> web.Response:
    status = request.app[WORKER].status()
    return web.json_response({"state": status.state}, status=200 if status.state == "ready" else 503)


# No token, like /healthz: it carries counts only (no text, voice, call id or address), workers listen on loopback
# unless an operator opens them to remote gateways (engine.worker.listen_host, --listen), and the token is the
# gateways' key to synthesis: handing it to a scraper would let the monitoring system open streams.
async def _metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[WORKER].metrics.exposition(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _status_endpoint(request: web.Request) -> web.Response:
    worker = request.app[WORKER]
    if not _authorized(request, worker.settings.token):
        return _unauthorized()
    body = {key: value for key, value in asdict(worker.status()).items() if key not in ("type", "opens_seen")}
    return web.json_response({"engine": worker.engine.name, **body})


async def _stream_endpoint(request: web.Request) -> web.StreamResponse:
    worker = request.app[WORKER]
    if not _authorized(request, worker.settings.token):
        return _unauthorized()
    version = request.query.get("version", "")
    if version != str(protocol.VERSION):
        return web.json_response({"error": f"engine protocol version {version or '(none)'} is not spoken here; "
                                           f"this worker speaks version {protocol.VERSION}"}, status=400)
    ws = web.WebSocketResponse(heartbeat=worker.settings.heartbeat_s, max_msg_size=1 << 20)
    await ws.prepare(request)
    await _Link(worker, ws, request.transport, request.remote or "?",
                graphs=request.query.get("graphs") == "1").serve()
    return ws


class _Link:
    """One gateway's WebSocket: reads its control frames, runs its streams, writes their frames in order."""

    def __init__(self, worker: EngineWorker, ws: web.WebSocketResponse, transport, peer: str,
                 graphs: bool = False) -> None:
        self._worker = worker
        self._graphs = graphs  # the gateway asked for status.graphs
        self._ws = ws
        self._transport = transport
        self._outbox: asyncio.Queue[str | bytes] = asyncio.Queue()
        self._outbox_bytes = 0
        self._status_queued = False
        self._opens_seen = 0  # this link's opens handled (status.opens_seen): each is in streams_active, or refused
        self._streams: dict[int, asyncio.Task[None]] = {}
        self._log = log.bind(peer=peer)

    async def serve(self) -> None:
        self._log.info("engine_link_opened", streams_active=self._worker.streams_active)
        self._send(protocol.serialize(self._worker.hello()))
        writer = asyncio.create_task(self._write(), name="engine-link-writer")
        ticker = asyncio.create_task(self._tick(), name="engine-link-status")
        self._worker.metrics.links_open.inc()
        try:
            async for message in self._ws:
                if message.type == WSMsgType.TEXT:
                    self._on_text(message.data)
                elif message.type == WSMsgType.BINARY:
                    self._send_error(None, "binary frames are audio, sent by the worker only")
        finally:
            self._worker.metrics.links_open.dec()
            for task in (writer, ticker, *self._streams.values()):
                task.cancel()
            await asyncio.gather(writer, ticker, *self._streams.values(), return_exceptions=True)
            await self._ws.close()
            self._log.info("engine_link_closed", streams_active=self._worker.streams_active)

    # -- reading -----------------------------------------------------------------------------------
    def _on_text(self, text: str) -> None:
        try:
            frame = protocol.parse(text)
        except protocol.ProtocolError as exc:
            self._log.warning("engine_frame_malformed", error=str(exc), stream=exc.stream)
            if exc.stream is not None and exc.stream not in self._streams and '"open"' in text:
                self._opens_seen += 1  # an open all the same: the gateway counted it as sent
                self._refuse(exc.stream, "bad_request", str(exc))
            else:
                self._send_error(exc.stream, str(exc))
            return
        if isinstance(frame, protocol.Open):
            self._open(frame)
        elif isinstance(frame, protocol.Cancel):
            task = self._streams.get(frame.stream)
            if task is not None:
                task.cancel()
        else:
            self._send_error(getattr(frame, "stream", None), f"{frame.type} frames are sent by the worker only")

    def _open(self, frame: protocol.Open) -> None:
        worker, engine = self._worker, self._worker.engine
        self._opens_seen += 1  # in the same step as streams_active, so no status counts one without the other
        refusal: tuple[str, str] | None = None
        if frame.stream in self._streams:
            refusal = ("bad_request", f"stream {frame.stream} is already open on this link")
        elif frame.sample_rate != engine.sample_rate:
            refusal = ("bad_request", f"sample_rate {frame.sample_rate} is not offered; this engine makes "
                                      f"{engine.sample_rate} Hz (resample on the gateway)")
        elif (status := worker.status()).state != "ready":
            refusal = ("unavailable", f"engine {status.state}")
        elif status.slots_free <= 0:
            # The engine's own reason where it has one (a runtime behind real time sheds: CosyVoice2's shed_late_s).
            refusal = ("no_capacity", engine.health().reason or f"all {worker.settings.slots} slots are taken")
        if refusal is not None:
            self._refuse(frame.stream, *refusal)
            return
        try:
            request = SynthesisRequest(text=frame.text, voice=frame.voice, call_id=frame.call_id,
                                       options=MappingProxyType(dict(frame.options)),
                                       segments=from_wire(frame.segments), paced=frame.paced)
        except ValueError as exc:
            self._refuse(frame.stream, "bad_text", str(exc))
            return
        try:
            channel = engine.open_stream(request)
        except SynthesisRefused as exc:
            self._refuse(frame.stream, protocol.refusal_reason(exc), str(exc))
            return
        except Exception as exc:  # noqa: BLE001 - the engine could not take it: say so, keep serving others
            self._log.exception("engine_open_failed", call_id=frame.call_id)
            self._refuse(frame.stream, "unavailable", repr(exc))
            return
        key = worker.next_key()
        worker.streams_active += 1
        opened_at = time.monotonic()
        worker.estimate.opened(key, opened_at)
        task = asyncio.create_task(self._pump(frame, channel, key, opened_at), name=f"engine-stream-{frame.call_id}")
        task.add_done_callback(lambda done: self._stream_done(frame.stream, done, channel, key))
        self._streams[frame.stream] = task

    def _stream_done(self, stream: int, task: asyncio.Task[None], channel, key: int) -> None:
        """The slot comes back whenever the stream's task ends, also when it was cancelled before it ever ran (an
        open and its cancel read in one go, as when a gateway moves an open off a worker that was stalled): such
        a task never enters _pump, so a `finally` there would keep the slot for good."""
        channel.cancel()
        self._worker.estimate.gone(key)
        self._worker.streams_active -= 1
        if self._streams.get(stream) is task:
            del self._streams[stream]

    # -- one stream ------------------------------------------------------------------------------
    async def _pump(self, frame: protocol.Open, channel, key: int, opened_at: float) -> None:
        worker, stream, metrics = self._worker, frame.stream, self._worker.metrics
        first = True
        outcome: str | None = None  # set once admitted: every admitted stream ends with one outcome
        try:
            try:
                await channel.admitted()
            except SynthesisRefused as exc:
                self._refuse(stream, protocol.refusal_reason(exc), str(exc))
                return
            self._send(protocol.serialize(protocol.Opened(stream)))
            metrics.streams_opened.labels(protocol.STREAM_PATH).inc()
            outcome = "cancelled"  # unless it completes or fails below
            try:
                async for chunk in channel:
                    if first:
                        now = time.monotonic()
                        worker.estimate.first_chunk(key, now)
                        metrics.first_chunk_seconds.observe(now - opened_at)
                        first = False
                    self._send(protocol.encode_audio(stream, chunk, frame.format))
            except SynthesisFailed as exc:
                outcome = "failed"
                self._send(protocol.serialize(protocol.Failed(stream, str(exc))))
                return
            outcome = "completed"
            self._send(protocol.serialize(protocol.End(stream)))
        finally:  # the slot is given back by _stream_done
            if outcome is not None:
                metrics.streams_ended.labels(protocol.STREAM_PATH, outcome).inc()

    # -- writing ---------------------------------------------------------------------------------
    def _send(self, data: str | bytes) -> None:
        self._outbox_bytes += len(data)
        self._outbox.put_nowait(data)
        if self._outbox_bytes > self._worker.settings.max_outbox_bytes and not self._transport.is_closing():
            # The writer is stuck in a send the gateway never reads: drop the connection, not the engine.
            self._log.error("engine_link_not_reading", queued_bytes=self._outbox_bytes)
            self._transport.abort()

    def _refuse(self, stream: int, reason: str, message: str) -> None:
        self._worker.metrics.refusals.labels(reason).inc()
        self._send(protocol.serialize(protocol.Refused(stream, reason, message)))

    def _send_error(self, stream: int | None, message: str) -> None:
        self._send(protocol.serialize(protocol.Error(stream, message)))

    async def _write(self) -> None:
        while True:
            data = await self._outbox.get()
            self._outbox_bytes -= len(data)
            if data is _STATUS_DUE:  # built when it leaves, so it says how things are now
                self._status_queued = False
                data = protocol.serialize(self._worker.status(self._opens_seen, self._graphs))
            if isinstance(data, str):
                await self._ws.send_str(data)
            else:
                await self._ws.send_bytes(data)

    async def _tick(self) -> None:
        while True:  # a period (the heartbeat), not media pacing
            if not self._status_queued:  # a backed-up link gets one fresh status, not a pile of stale ones
                self._status_queued = True
                self._send(_STATUS_DUE)
            await asyncio.sleep(self._worker.settings.status_interval_s)
