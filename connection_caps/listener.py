"""An aiohttp listener with caps: `CappedSite` admits each accepted connection through `ConnectionCaps` before
aiohttp sees it, closes one whose first request head is not complete within `header_timeout_s` (slowloris),
and leaves idle keep-alive connections to aiohttp's own `keepalive_timeout` (pass `runner_options(limits)` to
the AppRunner). That one also bounds a later request's head: aiohttp closes a connection whose next request
is not whole `idle_timeout_s` after the last answer. A connection refused at accept is aborted before any byte
is read.

`quiet_accept_errors` keeps asyncio's accept-loop errors (EMFILE/ENFILE at the descriptor limit) from writing a
traceback per attempt: they are counted and logged once per interval.

Metric objects come from the process that owns them (gateway/metrics.py, engine_service/metrics.py); this
module defines no names. Never: import the gateway, the engines or the engine service.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from aiohttp import web

from connection_caps.budget import ConnectionCaps

log = structlog.get_logger(__name__)

_HEAD_END = b"\r\n\r\n"
ACCEPT_BACKLOG = 64  # also what asyncio accepts per round: each holds a descriptor until it is judged
_MAX_HEAD_BYTES = 16384  # a probation connection's head, read to find its credentials; more is not trusted


@dataclass(frozen=True)
class HttpLimits:
    max_connections: int = 256
    max_connections_per_source: int = 64
    idle_timeout_s: float = 60.0  # a keep-alive connection with no request for this long is closed
    header_timeout_s: float = 10.0  # a connection's first request head must be complete within this


def runner_options(limits: HttpLimits) -> dict[str, Any]:
    """AppRunner keyword arguments for these limits (aiohttp closes a keep-alive connection idle this long)."""
    return {"keepalive_timeout": limits.idle_timeout_s}


class CounterLike(Protocol):
    def labels(self, *values: str) -> Any: ...


@dataclass(frozen=True)
class ListenerMetrics:
    """The owner's metric objects: refused{reason}, closed{reason}, open (a gauge)."""

    refused: CounterLike
    closed: CounterLike
    open: Any


TrustedHead = Callable[[bytes], bool]


@dataclass
class ListenerGuard:
    caps: ConnectionCaps
    limits: HttpLimits
    metrics: ListenerMetrics
    trusted: TrustedHead | None = None  # confirms a probation connection from its request head
    on_probation: list[_CappedConnection] = field(default_factory=list)  # oldest first


class _CappedConnection(asyncio.Protocol):
    """Admission and the header timer in front of one aiohttp RequestHandler (created only once admitted)."""

    def __init__(self, guard: ListenerGuard, handler_factory: Callable[[], asyncio.Protocol]) -> None:
        self._guard = guard
        self._factory = handler_factory
        self._inner: asyncio.Protocol | None = None
        self._transport: asyncio.Transport | None = None
        self._source = ""
        self._probation = False
        self._head = bytearray()
        self._head_done = False
        self._timer: asyncio.TimerHandle | None = None
        self._released = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        guard = self._guard
        peer = transport.get_extra_info("peername")
        self._source = str(peer[0]) if peer else "?"
        verdict = guard.caps.admit(self._source)
        if verdict in ("max_connections", "max_connections_per_source") and guard.on_probation:
            # The reserve is full of connections that have not proved themselves: the oldest makes way, so a
            # flood of idle connections cannot keep a trusted peer (whose head comes at once) out.
            guard.on_probation[0]._evict()
            verdict = guard.caps.admit(self._source)
        if verdict not in (None, "probation"):
            guard.metrics.refused.labels(verdict).inc()
            transport.abort()
            return
        self._probation = verdict == "probation"
        if self._probation:
            guard.on_probation.append(self)
        self._transport = transport
        guard.metrics.open.inc()
        self._timer = asyncio.get_running_loop().call_later(guard.limits.header_timeout_s, self._header_timeout)
        self._inner = self._factory()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._inner is None:
            return
        if not self._head_done:
            tail = bytes(self._head[-3:])
            self._head += data
            if _HEAD_END in tail + data:
                self._head_done = True
                self._cancel_timer()
                if self._probation and not self._confirm():
                    return
                self._head = bytearray()
            elif len(self._head) > _MAX_HEAD_BYTES:
                self._head = self._head[-3:]  # aiohttp answers an oversized head itself (431 / 400)
                if self._probation:
                    self._close("untrusted")
                    return
        self._inner.data_received(data)

    def _confirm(self) -> bool:
        guard = self._guard
        if guard.trusted is not None and guard.trusted(bytes(self._head)):
            guard.caps.confirm()
            guard.on_probation.remove(self)
            self._probation = False
            return True
        self._close("untrusted")
        return False

    def _evict(self) -> None:
        """Make way at once: the caps are released now, not when the transport reports the loss."""
        self._close("evicted")
        self._release()

    def _header_timeout(self) -> None:
        self._timer = None
        self._close("header_timeout")

    def _close(self, reason: str) -> None:
        self._guard.metrics.closed.labels(reason).inc()
        if self._transport is not None:
            self._transport.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._inner is not None else None

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        inner = self._inner
        self._release()
        if inner is not None:
            inner.connection_lost(exc)

    def _release(self) -> None:
        if self._inner is None or self._released:
            return
        self._released = True
        self._cancel_timer()
        guard = self._guard
        guard.caps.release(self._source, self._probation)
        if self._probation:
            guard.on_probation.remove(self)
        guard.metrics.open.dec()


class CappedSite(web.TCPSite):
    """A TCPSite whose connections go through a ListenerGuard first."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, guard: ListenerGuard) -> None:
        super().__init__(runner, host, port)
        self._guard = guard

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _CappedConnection(self._guard, server), self._host, self._port,
            backlog=ACCEPT_BACKLOG, reuse_address=self._reuse_address)
        self._bound_port = self._server.sockets[0].getsockname()[1]


_ACCEPT_ERROR = "socket.accept() out of system resource"


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, counter: Any, interval_s: float = 10.0) -> None:
    """Count asyncio's accept errors and log them once per `interval_s`, without a traceback; other contexts go
    to the handler that was installed before (or the default one). asyncio pauses accepting for a second after
    such an error on its own."""
    previous = loop.get_exception_handler()
    last_logged = [float("-inf")]
    since = [0]

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") == _ACCEPT_ERROR:
            counter.inc()
            since[0] += 1
            now = time.monotonic()
            if now - last_logged[0] >= interval_s:
                exc = context.get("exception")
                log.error("accept_failed", error=getattr(exc, "strerror", None) or repr(exc), count=since[0])
                last_logged[0], since[0] = now, 0
            return
        if previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
