"""Prometheus metrics of one engine worker: the one place their names and labels are defined.

A worker is a process of its own, so it has a registry of its own (never the gateway's), one per application,
served at `GET /metrics` of the worker's server. What the worker already keeps (state, slots, streams in use,
queue, first-audio estimate) is read from `EngineWorker.status()` when Prometheus scrapes, so nothing is counted
twice; only events (streams opened and ended, refusals, first chunks, HTTP requests) are counted as they happen.
Labels come from bounded sets: the protocol's refusal reasons, the stream outcomes, the server's route paths and
HTTP status codes. Never: a call id, a text or a client's address as a label; an import of the gateway.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from engine_service import protocol
from engine_service.api.streaming_response import FIRST_BYTE_AT
from speech_audio.cache_metrics import PromptCacheCollector

# The gateway's tts_first_chunk_latency_seconds buckets, so a worker's figure and the gateway's compare bucket by
# bucket (the gateway's adds the link's hop).
FIRST_CHUNK_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0)
STREAM_OUTCOMES = ("completed", "failed", "cancelled")
STATES = ("ready", "warming", "down")
# The route of the request being handled (set by the middleware), so a stream the speech API opens deep in a
# handler's tasks is labelled with it.
_ROUTE: ContextVar[str] = ContextVar("tts_worker_route", default="unmatched")


class WorkerView(Protocol):
    """What the scrape reads of the worker (engine_service.server.EngineWorker)."""

    streams_active: int

    def status(self) -> protocol.Status: ...


class WorkerMetrics:
    """One worker's counters and histograms, and the collector of its status, in a registry of its own."""

    def __init__(self, worker: WorkerView) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.links_open = Gauge("tts_worker_links_open", "Gateway links (WebSockets) open", registry=registry)
        self.streams_opened = Counter(
            "tts_worker_streams_opened_total", "Streams admitted, by route (/v1/engine/stream: a gateway's link, an "
            "opened frame sent; the speech API's routes: an admitted stream)", ["route"], registry=registry)
        self.refusals = Counter(
            "tts_worker_refusals_total",
            f"Gateway opens refused, by the protocol's reason ({', '.join(protocol.REFUSAL_REASONS)})",
            ["reason"], registry=registry)
        self.streams_ended = Counter(
            "tts_worker_streams_ended_total",
            "Admitted streams that ended, by route and outcome (completed: all audio sent; failed: the engine "
            "broke mid-stream; cancelled: a cancel frame, the link closed or the API's client stopped it)",
            ["route", "outcome"], registry=registry)
        self.first_chunk_seconds = Histogram(
            "tts_worker_first_chunk_latency_seconds",
            "Time from a gateway's open frame to the stream's first audio chunk, in the worker",
            buckets=FIRST_CHUNK_BUCKETS, registry=registry)
        self.http_requests = Counter(
            "tts_worker_http_requests_total",
            "HTTP requests answered by the worker's server (speech API, status, link upgrades), by route and "
            "status code (101: a WebSocket); a request whose client left before any answer is not counted",
            ["endpoint", "code"], registry=registry)
        self.api_first_byte_seconds = Histogram(
            "tts_api_first_byte_latency_seconds",
            "Speech API over HTTP: time from the request to its first audio bytes, by route",
            ["endpoint"], buckets=FIRST_CHUNK_BUCKETS, registry=registry)
        self.http_refused = Counter(
            "tts_worker_http_connections_refused_total",
            "Connections to the worker's port closed at accept, by reason (max_connections, "
            "max_connections_per_source, descriptors)", ["reason"], registry=registry)
        self.http_closed = Counter(
            "tts_worker_http_connections_closed_total",
            "Connections the worker closed, by reason (header_timeout; untrusted: past the caps, on the links' "
            "reserve, without the engine token)", ["reason"], registry=registry)
        self.http_open = Gauge("tts_worker_http_connections_open", "Connections to the worker's port open now",
                               registry=registry)
        self.accept_errors = Counter(
            "tts_worker_accept_errors_total",
            "Failed accepts on the worker's port (EMFILE/ENFILE at the descriptor limit); logged once per 10 s",
            registry=registry)
        registry.register(_StatusCollector(worker))

    def watch_api(self, api: ApiView) -> None:
        """The speech API's own counts (wrong keys, slow clients, audio waiting for them), read at scrape time."""
        self.registry.register(_ApiCollector(api))
        api.stream_events = _RouteStreams(self.streams_opened, self.streams_ended)

    def watch_prompt_cache(self, cache) -> None:
        """The speech API's prompt cache (speech_audio/prompt_cache.py), as tts_api_prompt_cache_hits_total{where},
        _misses_total, _fill_failures_total, _corrupt_files_total, _evictions_total{tier}, _bytes{tier},
        _entries{tier}; read at scrape time."""
        collector = PromptCacheCollector("tts_api_prompt_cache")
        collector.cache = cache
        self.registry.register(collector)

    def watch_stalls(self, watch: StallView) -> None:
        """The worker's stalls (engine_service.stall_watch), as tts_worker_stalls_total and
        tts_worker_stalled_seconds_total; read at scrape time."""
        self.registry.register(_StallCollector(watch))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def middleware(self):
        """An aiohttp middleware counting every request by route and status, and the API's first-byte time."""

        @web.middleware
        async def count(request: web.Request, handler):
            started = time.monotonic()
            code: int | None = None
            route = _ROUTE.set(_endpoint(request))
            try:
                response = await handler(request)
                code = response.status
                return response
            except web.HTTPException as exc:
                code = exc.status
                raise
            except Exception:
                code = 500  # what aiohttp answers for a handler's unexpected exception
                raise
            finally:
                _ROUTE.reset(route)
                endpoint = _endpoint(request)
                if code is not None:
                    self.http_requests.labels(endpoint, str(code)).inc()
                if (first_byte_at := request.get(FIRST_BYTE_AT)) is not None:
                    self.api_first_byte_seconds.labels(endpoint).observe(first_byte_at - started)

        return count


def _endpoint(request: web.Request) -> str:
    """The route's path as registered (`/v1/tts`), never the raw path: a stranger's URLs must not make series."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else "unmatched"


class _RouteStreams:
    """The speech API's stream events, labelled with the route of the request that opened the stream."""

    def __init__(self, opened: Counter, ended: Counter) -> None:
        self._opened, self._ended = opened, ended

    def opened(self) -> None:
        self._opened.labels(_ROUTE.get()).inc()

    def ended(self, outcome: str) -> None:
        self._ended.labels(_ROUTE.get(), outcome).inc()


class ApiView(Protocol):
    """What the scrape reads of the speech API (engine_service.api.context.TtsApi)."""

    stream_events: Any  # WorkerMetrics.watch_api sets it
    key_failures: Any
    buffers: Any


class _ApiCollector(Collector):
    def __init__(self, api: ApiView) -> None:
        self._api = api

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        failures, buffers = self._api.key_failures, self._api.buffers
        keys = CounterMetricFamily(
            "tts_api_key_failures", "Speech API requests with a missing or wrong key, by action (refused: 401; "
            "limited: 429 without the key checked, the source being past tts_api.max_key_failures)",
            labels=["action"])
        keys.add_metric(["refused"], failures.refused)
        keys.add_metric(["limited"], failures.limited)
        yield keys
        yield CounterMetricFamily("tts_api_slow_clients", "Speech API streams cut because the client did not take "
                                  "its audio within tts_api.slow_client_timeout_s", value=buffers.slow_clients)
        yield GaugeMetricFamily("tts_api_stream_buffered_bytes", "Speech API audio made and not yet taken by its "
                                "clients, over all streams", value=buffers.buffered_bytes)


class StallView(Protocol):
    """What the scrape reads of the stall watch (engine_service.stall_watch.StallWatch)."""

    stalls: int
    stalled_s: float


class _StallCollector(Collector):
    def __init__(self, watch: StallView) -> None:
        self._watch = watch

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily("tts_worker_stalls", "Times this worker's Python stopped running for longer than "
                                  "the stall watch's report_after_s (0.25 s; a gateway calls a worker dead after ~1 s)",
                                  value=self._watch.stalls)
        yield CounterMetricFamily("tts_worker_stalled_seconds", "Seconds lost in those stalls",
                                  value=self._watch.stalled_s)


class _StatusCollector(Collector):
    """The worker's status as gauges, read at scrape time (the same figures as the status frame)."""

    def __init__(self, worker: WorkerView) -> None:
        self._worker = worker

    def describe(self) -> list:
        return []  # nothing to describe ahead: registering must not ask the engine for its health

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        status = self._worker.status()
        state = GaugeMetricFamily("tts_worker_state", "1 for the engine's state now (ready, warming, down)",
                                  labels=["state"])
        for name in STATES:
            state.add_metric([name], 1.0 if status.state == name else 0.0)
        yield state
        yield GaugeMetricFamily("tts_worker_slots_total", "Streams the worker serves at once",
                                value=status.slots_total)
        yield GaugeMetricFamily("tts_worker_slots_free", "Slots free now (what a gateway's status frame says)",
                                value=status.slots_free)
        yield GaugeMetricFamily("tts_worker_streams_active", "Slots in use: gateway streams and speech API streams",
                                value=self._worker.streams_active)
        yield GaugeMetricFamily("tts_worker_queue_depth",
                                "Gateway streams admitted and still waiting for their first audio",
                                value=status.queue_depth)
        yield GaugeMetricFamily("tts_worker_first_audio_estimate_seconds",
                                "The worker's estimate of first audio for a stream opened now (admission bound)",
                                value=status.first_audio_ms / 1000)
        # The engine's compiled graphs (cosyvoice2 on CUDA is ready on slower graphs of the eager modules and
        # swaps the compiled ones in while serving, ~2 min): 0 while first chunks are still 2-4x slower.
        yield GaugeMetricFamily("tts_worker_graphs_compiled",
                                "1 when the engine runs at full speed (its compiled graphs are in, or it has none "
                                "to compile); 0 while it serves on slower graphs (compiling, or compiling failed)",
                                value=1.0 if status.graphs == "compiled" else 0.0)
        yield CounterMetricFamily("tts_worker_graph_compile_failures",
                                  "Compiles of the engine's graphs that failed (the worker serves on, on the slower "
                                  "graphs, until restarted)", value=1.0 if status.graphs == "failed" else 0.0)
