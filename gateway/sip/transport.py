"""SIP over UDP and TCP on one host:port (RFC 3261 §18): framing, connections, where to send.

The transport layer moves bytes; it never parses beyond what stream framing needs (§18.3:
Content-Length delimits messages on TCP). Every received message is handed up as
`(data, Peer)`; `Peer` remembers the connection it came on so responses can go back on it
(§18.2.2). TCP connections are kept open and reused for requests to the same address.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from gateway.sip.message import ParseError, content_length_of

log = structlog.get_logger(__name__)

_MAX_HEADER_BYTES = 64 * 1024  # a stream that sends more without a blank line is not SIP
_MAX_BODY_BYTES = 1024 * 1024
_BIND_ATTEMPTS = 10


@dataclass(frozen=True, eq=False)
class Peer:
    """Where a message came from: transport, source address and (TCP) the connection."""

    transport: str  # "udp" | "tcp"
    address: tuple[str, int]
    connection: _StreamConnection | None = None


OnMessage = Callable[[bytes, Peer], None]


class _DatagramEndpoint(asyncio.DatagramProtocol):
    def __init__(self, on_message: OnMessage) -> None:
        self._on_message = on_message

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        if data.strip(b"\r\n\t ") == b"":  # RFC 5626 §3.5.1 keep-alive, not a message
            return
        self._on_message(data, Peer("udp", (addr[0], addr[1])))

    def error_received(self, exc: Exception) -> None:  # ICMP unreachable etc.: UDP is best effort
        log.debug("udp_error", error=repr(exc))


class _StreamConnection(asyncio.Protocol):
    """One TCP connection: splits the byte stream into messages by Content-Length (§18.3)."""

    def __init__(self, transport_layer: SipTransport) -> None:
        self._layer = transport_layer
        self._buffer = bytearray()
        self._stream: asyncio.Transport | None = None
        self.address: tuple[str, int] = ("", 0)
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._stream = transport
        peer = transport.get_extra_info("peername")
        self.address = (peer[0], peer[1])
        self._layer._connections[self.address] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._layer._connections.get(self.address) is self:
            del self._layer._connections[self.address]

    def write(self, data: bytes) -> None:
        if self._stream is not None and not self.closed:
            self._stream.write(data)

    def close(self) -> None:
        if self._stream is not None:
            self._stream.close()

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while self._take_one():
            pass

    def _take_one(self) -> bool:
        buffer = self._buffer
        # RFC 5626 §3.5.1: CRLFCRLF is a keep-alive ping answered with CRLF; stray CRLFs are skipped.
        while buffer[:2] == b"\r\n":
            if buffer[:4] == b"\r\n\r\n":
                del buffer[:4]
                self.write(b"\r\n")
            else:
                del buffer[:2]
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEADER_BYTES:
                self._fail(bytes(buffer))
            return False
        head = bytes(buffer[: end + 4])
        try:
            length = content_length_of(head.decode("utf-8", "replace"))
        except ParseError:
            length = None
        if length is None or length > _MAX_BODY_BYTES:
            self._fail(head)  # cannot find the next message boundary: let the parser answer 400
            return False
        if len(buffer) < end + 4 + length:
            return False
        frame = bytes(buffer[: end + 4 + length])
        del buffer[: end + 4 + length]
        self._layer._deliver(frame, Peer("tcp", self.address, self))
        return True

    def _fail(self, data: bytes) -> None:
        self._buffer.clear()
        self._layer._deliver(data, Peer("tcp", self.address, self))
        self.close()


class SipTransport:
    """UDP and TCP listeners sharing one host:port, and the sending side for both."""

    def __init__(self, host: str, port: int, transports: tuple[str, ...], on_message: OnMessage) -> None:
        self._host, self._port, self._kinds = host, port, transports
        self._on_message = on_message
        self._udp: asyncio.DatagramTransport | None = None
        self._server: asyncio.Server | None = None
        self._connections: dict[tuple[str, int], _StreamConnection] = {}
        self._connecting: dict[tuple[str, int], asyncio.Task[_StreamConnection]] = {}
        self.udp_address: tuple[str, int] | None = None
        self.tcp_address: tuple[str, int] | None = None

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
                lambda: _DatagramEndpoint(self._deliver), local_addr=(self._host, port))
            self.udp_address = self._udp.get_extra_info("sockname")[:2]
            port = self.udp_address[1]
        if "tcp" in self._kinds:
            self._server = await loop.create_server(
                lambda: _StreamConnection(self), self._host, port, reuse_address=True)
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

    def _deliver(self, data: bytes, peer: Peer) -> None:
        try:
            self._on_message(data, peer)
        except Exception:  # one bad message must never take the listener down
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
        _, connection = await loop.create_connection(lambda: _StreamConnection(self), *address)
        return connection


async def resolve(host: str, port: int) -> tuple[str, int]:
    """An IP literal as is; a name through the resolver off the event loop (not RFC 3263 SRV)."""
    try:
        ipaddress.ip_address(host)
        return host, port
    except ValueError:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
        return infos[0][4][0], port
