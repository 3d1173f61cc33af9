"""SIP over UDP and TCP on one host:port (RFC 3261 §18): framing, connections, where to send.

The transport layer moves bytes; it never parses beyond what stream framing needs (§18.3:
Content-Length delimits messages on TCP). Every received message is handed up as
`(data, Peer)`; `Peer` remembers the connection it came on so responses can go back on it
(§18.2.2). TCP connections are kept open and reused for requests to the same address.
What a TCP peer may cost is bounded by `StreamLimits`: connections in total and per source (checked,
with the trunk allow-list, at accept), idle and read timeouts, the size of one message, and the bytes
queued for a peer that does not read (over it the connection is closed). Keep-alives (RFC 5626 §3.5.1)
and new connections are charged to the source's request budget through `SourceBudget`; a peer over it
is closed (refused at accept), never answered without limit. One connection never holds the loop: a
read that carries many messages is handled `_MESSAGES_PER_TURN` at a time, reading paused, the rest on
the loop's next turns (the packet clock runs between them).
"""

from __future__ import annotations

import asyncio
import ipaddress
import re
import resource
import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from connection_caps.budget import DescriptorBudget
from gateway import metrics
from gateway.sip.message import ParseError, content_length_of

log = structlog.get_logger(__name__)

_BIND_ATTEMPTS = 10
_FD_RESERVE = 256  # descriptors kept free for RTP/RTCP sockets, /healthz and log files
# Messages handled per loop turn from one connection: a full INVITE costs ~0.3 ms, so a turn stays a few
# ms however many a peer pipelines (2,000 in one write held the clock 89-114 ms when handled at once).
_MESSAGES_PER_TURN = 8
_CRLF_RUN = re.compile(rb"(?:\r\n)+")
_KEEPALIVE_WINDOW = 4096  # bytes of a CRLF run looked at, and charged, at once (1,024 pings)


@dataclass(frozen=True)
class StreamLimits:
    """What one TCP peer may cost us. Without these, idle or half-sent connections stay forever and
    enough of them exhaust the process's file descriptors, which breaks UDP calls and /healthz too."""

    max_connections: int = 500
    max_connections_per_source: int = 50
    idle_timeout_s: float = 60.0  # no byte at all for this long: close
    read_timeout_s: float = 10.0  # a message begun must be complete within this (slowloris)
    max_message_bytes: int = 65535  # headers + body of one message, UDP or TCP
    # The process's descriptors for connections, shared with the HTTP port (connection_caps); None: unshared.
    budget: DescriptorBudget | None = None
    max_unsent_bytes: int = 262144  # responses queued for a peer that does not read: over it, close


@dataclass(frozen=True, eq=False)
class Peer:
    """Where a message came from: transport, source address and (TCP) the connection."""

    transport: str  # "udp" | "tcp"
    address: tuple[str, int]
    connection: _StreamConnection | None = None


OnMessage = Callable[[bytes, Peer], None]
# A stream whose framing broke: the header block (may be empty), the peer, and the status to answer.
OnStreamError = Callable[[bytes, Peer, int, str], None]
SourceAllowed = Callable[[str], bool]
# Whether a source may spend `cost` requests now (keep-alive pings, a new connection); a peer over it is closed.
SourceBudget = Callable[[str, int], bool]


class _DatagramEndpoint(asyncio.DatagramProtocol):
    def __init__(self, on_message: OnMessage, max_bytes: int) -> None:
        self._on_message = on_message
        self._max_bytes = max_bytes

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if data.strip(b"\r\n\t ") == b"":  # RFC 5626 §3.5.1 keep-alive, not a message
            return
        if len(data) > self._max_bytes:
            metrics.sip_dropped_total.labels(reason="oversize").inc()
            return
        self._on_message(data, Peer("udp", (addr[0], addr[1])))

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable etc.: UDP is best effort
        log.debug("udp_error", error=repr(exc))


class _StreamConnection(asyncio.Protocol):
    """One TCP connection: splits the byte stream into messages by Content-Length (§18.3).

    The buffer never holds more than one message's worth (`max_message_bytes`); the search for the
    blank line resumes where the last read left off, so a header sent a byte at a time costs O(n),
    not O(n^2). Two timers guard the connection: idle (no bytes) and read (a message left unfinished).
    """

    def __init__(self, transport_layer: SipTransport, inbound: bool) -> None:
        self._layer = transport_layer
        self._limits = transport_layer.limits
        self._inbound = inbound
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer already searched for the end of the header block
        self._frame_length: int | None = None  # the current message's total length, once known
        self._stream: asyncio.Transport | None = None
        self._loop = asyncio.get_running_loop()
        self._last_activity = self._loop.time()
        self._idle_timer: asyncio.TimerHandle | None = None
        self._read_timer: asyncio.TimerHandle | None = None
        self._next_turn: asyncio.Handle | None = None  # the rest of a read with many messages
        self._fresh = False  # since the read timer was armed, a message started or completed
        self.address: tuple[str, int] = ("", 0)
        self.closed = False
        self.admitted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._stream = transport
        peer = transport.get_extra_info("peername")
        self.address = (peer[0], peer[1])
        refusal = self._layer._admit(self) if self._inbound else None
        if refusal is not None:
            metrics.sip_tcp_refused_total.labels(reason=refusal).inc()
            self.closed = True
            transport.abort()  # at accept: no byte of an unwanted peer is read or buffered
            return
        self.admitted = True
        self._layer._connections[self.address] = self
        self._layer._per_source[self.address[0]] = self._layer._per_source.get(self.address[0], 0) + 1
        self._idle_timer = self._loop.call_later(self._limits.idle_timeout_s, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timers()
        if not self.admitted:
            return
        self.admitted = False
        layer = self._layer
        if layer.limits.budget is not None and self._inbound:  # outbound ones took none (_admit)
            layer.limits.budget.give_back()
        if layer._connections.get(self.address) is self:
            del layer._connections[self.address]
        left = layer._per_source.get(self.address[0], 1) - 1
        if left > 0:
            layer._per_source[self.address[0]] = left
        else:
            layer._per_source.pop(self.address[0], None)

    def write(self, data: bytes) -> None:
        if self._stream is not None and not self.closed:
            self._last_activity = self._loop.time()
            self._stream.write(data)
            unsent = self._stream.get_write_buffer_size()
            if unsent > self._limits.max_unsent_bytes:
                # A peer that sends but never reads would grow this buffer (and our RSS) without bound.
                metrics.sip_tcp_closed_total.labels(reason="unread").inc()
                log.warning("sip_tcp_unread_closed", source=f"{self.address[0]}:{self.address[1]}",
                            unsent_bytes=unsent)
                self._abort()

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def _cancel_timers(self) -> None:
        for timer in (self._idle_timer, self._read_timer, self._next_turn):
            if timer is not None:
                timer.cancel()
        self._idle_timer = self._read_timer = self._next_turn = None

    def _check_idle(self) -> None:
        quiet = self._loop.time() - self._last_activity
        if quiet >= self._limits.idle_timeout_s:
            metrics.sip_tcp_closed_total.labels(reason="idle_timeout").inc()
            self._abort()
        else:
            self._idle_timer = self._loop.call_later(self._limits.idle_timeout_s - quiet, self._check_idle)

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self._buffer:
            metrics.sip_tcp_closed_total.labels(reason="read_timeout").inc()
            self._abort()

    def _abort(self) -> None:
        self.closed = True
        self._buffer.clear()
        self._cancel_timers()
        if self._stream is not None:
            self._stream.abort()

    def data_received(self, data: bytes) -> None:
        self._last_activity = self._loop.time()
        self._fresh = self._fresh or not self._buffer  # this read starts a message
        self._buffer += data
        self._handle_some()

    def _handle_some(self) -> None:
        """Frame and deliver at most `_MESSAGES_PER_TURN` messages; more wait for the loop's next turn
        with reading paused, so the buffer holds at most one read plus one message."""
        self._next_turn = None
        if self.closed:
            return
        for _ in range(_MESSAGES_PER_TURN):
            if self.closed or not self._take_one():
                break
            self._fresh = True  # a message completed: what is left started in this read
        else:
            if not self.closed and self._stream is not None:
                self._stream.pause_reading()
                self._next_turn = self._loop.call_soon(self._handle_some)
                return
        if self.closed or self._stream is None:
            return
        self._stream.resume_reading()  # a no-op unless a previous turn paused it
        if self._read_timer is not None and (self._fresh or not self._buffer):
            self._read_timer.cancel()
            self._read_timer = None
        self._fresh = False
        if self._buffer and self._read_timer is None:
            # §18.3 gives no deadline; a message that trickles in forever holds memory and a descriptor.
            self._read_timer = self._loop.call_later(self._limits.read_timeout_s, self._read_timeout)

    def _take_one(self) -> bool:
        buffer = self._buffer
        if self._frame_length is None:
            # RFC 5626 §3.5.1: CRLFCRLF is a keep-alive ping answered with CRLF; stray CRLFs are skipped.
            while (run := _CRLF_RUN.match(buffer, 0, _KEEPALIVE_WINDOW)) is not None:
                if not self._keepalive(run.end()):
                    return False
                del buffer[: run.end()]
                self._scanned = 0
                if run.end() < _KEEPALIVE_WINDOW:
                    break
            end = buffer.find(b"\r\n\r\n", max(0, self._scanned - 3))
            if end < 0:
                self._scanned = len(buffer)
                if len(buffer) > self._limits.max_message_bytes:
                    self._fail(b"", 413, "header block larger than the message limit")
                return False
            head = bytes(buffer[: end + 4])
            try:
                length = content_length_of(head.decode("utf-8", "replace"))
            except ParseError as exc:
                self._fail(head, 400, exc.reason)  # no next message boundary: answer and close
                return False
            if length is None:
                self._fail(head, 400, "Content-Length required on a stream transport")
                return False
            if end + 4 + length > self._limits.max_message_bytes:
                self._fail(head, 413, f"message of {end + 4 + length} bytes exceeds the limit")
                return False
            self._frame_length = end + 4 + length
        if len(buffer) < self._frame_length:
            return False
        frame = bytes(buffer[: self._frame_length])
        del buffer[: self._frame_length]
        self._frame_length = None
        self._scanned = 0
        self._layer._deliver(frame, Peer("tcp", self.address, self))
        return True

    def _keepalive(self, length: int) -> bool:
        """One run of CRLFs (a window of it at most): charged to the source's budget, one ping per
        CRLFCRLF, and answered with one pong; a peer over its budget is closed (an honest one pings
        every 30 s or more, RFC 5626 §4.4.1), so no byte stream can make us answer without limit."""
        pings = length // 4
        if not self._layer._within_budget(self.address[0], max(1, pings)):
            metrics.sip_tcp_closed_total.labels(reason="keepalive_flood").inc()
            self._abort()
            return False
        if pings:
            self.write(b"\r\n")
        return True

    def _fail(self, head: bytes, status: int, reason: str) -> None:
        self._buffer.clear()
        self._frame_length = None
        self._scanned = 0
        self._layer._stream_error(head, Peer("tcp", self.address, self), status, reason)
        self.close()


class SipTransport:
    """UDP and TCP listeners sharing one host:port, and the sending side for both."""

    def __init__(self, host: str, port: int, transports: tuple[str, ...], on_message: OnMessage,
                 on_stream_error: OnStreamError | None = None, limits: StreamLimits = StreamLimits(),
                 source_allowed: SourceAllowed | None = None,
                 budget: SourceBudget | None = None) -> None:
        self._host, self._port, self._kinds = host, port, transports
        self._budget = budget
        self._on_message = on_message
        self._on_stream_error = on_stream_error
        self._source_allowed = source_allowed
        self.limits = limits
        self._max_connections = _descriptor_bounded(limits.max_connections)
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[tuple[str, int], _StreamConnection] = {}
        self._per_source: dict[str, int] = {}
        self._connecting: dict[tuple[str, int], asyncio.Task[_StreamConnection]] = {}
        self.udp_address: tuple[str, int] | None = None
        self.tcp_address: tuple[str, int] | None = None

    @property
    def connection_count(self) -> int:
        return len(self._connections)

    def _admit(self, connection: _StreamConnection) -> str | None:
        """Why an accepted connection must be closed at once, or None to keep it."""
        source = connection.address[0]
        if self._source_allowed is not None and not self._source_allowed(source):
            return "not_allowed"
        if len(self._connections) >= self._max_connections:
            return "max_connections"
        if self._per_source.get(source, 0) >= self.limits.max_connections_per_source:
            return "max_connections_per_source"
        if not self._within_budget(source, 1):  # a peer closed for flooding must not simply reconnect
            return "over_budget"
        if self.limits.budget is not None and not self.limits.budget.take():
            return "descriptors"
        return None

    def _within_budget(self, source: str, cost: int) -> bool:
        return self._budget is None or self._budget(source, cost)

    async def start(self) -> None:
        # With port 0, UDP picks a free port first and TCP must get the same one; retry if taken.
        for attempt in range(_BIND_ATTEMPTS):
            try:
                await self._bind()
                return
            except OSError:
                await self.stop()
                if self._port != 0 or attempt == _BIND_ATTEMPTS - 1:
                    raise

    async def _bind(self) -> None:
        loop = asyncio.get_running_loop()
        port = self._port
        if "udp" in self._kinds:
            self._udp, _ = await loop.create_datagram_endpoint(
                lambda: _DatagramEndpoint(self._deliver, self.limits.max_message_bytes),
                local_addr=(self._host, port))
            self.udp_address = self._udp.get_extra_info("sockname")[:2]
            port = self.udp_address[1]
        if "tcp" in self._kinds:
            self._server = await loop.create_server(
                lambda: _StreamConnection(self, inbound=True), self._host, port, reuse_address=True)
            self.tcp_address = self._server.sockets[0].getsockname()[:2]

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in self._connecting.values():
            task.cancel()
        for connection in list(self._connections.values()):
            connection.close()
        self._connections.clear()
        self._per_source.clear()

    def _deliver(self, data: bytes, peer: Peer) -> None:
        try:
            self._on_message(data, peer)
        except Exception:  # one bad message must never take the listener down
            log.exception("sip_message_handler_failed", source=f"{peer.address[0]}:{peer.address[1]}")

    def _stream_error(self, head: bytes, peer: Peer, status: int, reason: str) -> None:
        metrics.sip_tcp_closed_total.labels(reason="framing").inc()
        if self._on_stream_error is None:
            return
        try:
            self._on_stream_error(head, peer, status, reason)
        except Exception:
            log.exception("sip_message_handler_failed", source=f"{peer.address[0]}:{peer.address[1]}")

    def send(self, data: bytes, transport: str, address: tuple[str, int],
             connection: _StreamConnection | None = None) -> None:
        """Send without blocking. TCP prefers `connection`, then any open connection to `address`,
        then opens one (§18.2.2: if the original connection is gone, connect to the sent-by)."""
        if transport == "udp":
            if self._udp is not None:
                self._udp.sendto(data, address)
            return
        for candidate in (connection, self._connections.get(address)):
            if candidate is not None and not candidate.closed:
                candidate.write(data)
                return
        asyncio.get_running_loop().create_task(self._send_new_connection(data, address))

    async def _send_new_connection(self, data: bytes, address: tuple[str, int]) -> None:
        try:
            task = self._connecting.get(address)
            if task is None:
                task = asyncio.create_task(self._connect(address))
                self._connecting[address] = task
                task.add_done_callback(lambda _: self._connecting.pop(address, None))
            connection = await task
            connection.write(data)
        except OSError as exc:
            log.warning("tcp_connect_failed", address=f"{address[0]}:{address[1]}", error=repr(exc))

    async def _connect(self, address: tuple[str, int]) -> _StreamConnection:
        loop = asyncio.get_running_loop()
        _, connection = await loop.create_connection(lambda: _StreamConnection(self, inbound=False), *address)
        return connection


def _descriptor_bounded(wanted: int) -> int:
    """Keep TCP from taking the descriptors RTP sockets and /healthz need (RLIMIT_NOFILE is per process)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or wanted <= soft - _FD_RESERVE:
        return wanted
    bounded = max(1, soft - _FD_RESERVE)
    log.warning("sip_tcp_connections_capped", configured=wanted, allowed=bounded, nofile_limit=soft)
    return bounded


async def resolve(host: str, port: int) -> tuple[str, int]:
    """An IP literal as is; a name through the resolver off the event loop (not RFC 3263 SRV)."""
    try:
        ipaddress.ip_address(host)
        return host, port
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        return infos[0][4][0], port


def advertised_host_for(host: str, remote_ip: str) -> str:
    """The address to put in Contact/Via for a peer at `remote_ip`: `host` itself, unless it is a wildcard
    (0.0.0.0, ::), then the local IP the kernel would route to the peer (a connected UDP socket sends nothing)."""
    try:
        wildcard = ipaddress.ip_address(host).is_unspecified
    except ValueError:  # a hostname: advertised as it is
        return host
    if not wildcard:
        return host
    family = socket.AF_INET6 if ":" in remote_ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((remote_ip, 9))
        return probe.getsockname()[0]
