"""The MRCPv2 control listeners (RFC 6787 §4.2): TCP, and TLS when a certificate is configured (§4.2, §12.2:
TCP/TLS/MRCPv2), connections from clients framed into requests and handed to the channel each names.

A session's SIP answer names its channel (`a=channel:<id>@speechsynth`); the client then opens a connection
(`a=connection:new`) or reuses one it has to us (`existing`), and every request carries that id in
Channel-Identifier. Channels are found by id alone, so any number of sessions share a connection and a
channel's answers go back on the connection its last request came on.

What a peer cannot do: reach a channel it was not given (ids are 128-bit random; an unknown one gets 405),
connect from outside the trunks' allow-list (closed at accept), hold more than `max_connections`, or send a
message over `max_message_bytes` (504, then closed). A message that cannot be parsed gets its §5.4 status
with the request-id the start line gave; one that cannot be framed (no length to trust) also closes its
connection. None of this touches another connection or session.
"""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from gateway import metrics
from gateway.config_errors import ConfigError
from gateway.mrcp.message import (
    MANDATORY_HEADER_MISSING,
    RESOURCE_NOT_ALLOCATED,
    MessageError,
    MrcpResponse,
    read_request,
)
from gateway.mrcp.synthesizer import Synthesizer

log = structlog.get_logger(__name__)

_READ_BYTES = 65536
_MESSAGES_PER_TURN = 8  # then yield to the loop: a pipelined burst must not hold back the packet clock
_MAX_UNSENT_BYTES = 1 << 20  # a client that does not read its responses is cut off past this


@dataclass(frozen=True)
class MrcpSettings:
    listen_host: str = "127.0.0.1"
    listen_port: int = 1544
    max_connections: int = 200
    max_message_bytes: int = 65536
    idle_timeout_s: float = 3600.0  # a control connection with no byte this long is closed
    unattached_timeout_s: float = 30.0  # a session with no control connection this long is ended (BYE)
    voice_aliases: tuple[tuple[str, str], ...] = ()  # the config's `voices:` (alias -> engine voice)
    tls_listen: tuple[str, int] | None = None  # TCP/TLS/MRCPv2 on its own port, when a certificate is given
    tls_cert: str | None = None
    tls_key: str | None = None


class MrcpServer:
    def __init__(self, settings: MrcpSettings, allowed_sources: Callable[[], Sequence]) -> None:
        self.settings = settings
        self._allowed_sources = allowed_sources  # read at each accept: a SIGHUP's new trunks apply at once
        self._channels: dict[str, Synthesizer] = {}
        self._servers: list[asyncio.Server] = []
        self._connections: set[asyncio.StreamWriter] = set()
        self.port = settings.listen_port
        self.tls_port: int | None = None  # where TCP/TLS/MRCPv2 clients connect; None: no TLS

    async def start(self) -> None:
        settings = self.settings
        self.port = await self._listen("mrcp.listen", settings.listen_host, settings.listen_port, None)
        if settings.tls_listen is not None:
            context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            context.load_cert_chain(settings.tls_cert, settings.tls_key)
            self.tls_port = await self._listen("mrcp.tls.listen", *settings.tls_listen, context)
        log.info("mrcp_listening", host=settings.listen_host, port=self.port, tls_port=self.tls_port)

    async def _listen(self, key: str, host: str, port: int, context: ssl.SSLContext | None) -> int:
        try:
            server = await asyncio.start_server(self._serve, host, port, ssl=context)
        except OSError as exc:
            raise ConfigError([f"{key}: cannot listen on {host}:{port} (tcp): {exc.strerror or exc}"]) from None
        self._servers.append(server)
        return server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        for writer in list(self._connections):
            writer.close()
        for server in self._servers:
            await server.wait_closed()

    def add_channel(self, synthesizer: Synthesizer) -> None:
        self._channels[synthesizer.channel] = synthesizer

    def remove_channel(self, channel: str) -> None:
        self._channels.pop(channel, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername") or ("?", 0)
        if not self._allowed(peer[0]) or len(self._connections) >= self.settings.max_connections:
            log.info("mrcp_connection_refused", source=f"{peer[0]}:{peer[1]}",
                     reason="not_allowed" if not self._allowed(peer[0]) else "max_connections")
            writer.close()
            return
        self._connections.add(writer)
        log.info("mrcp_connection_opened", source=f"{peer[0]}:{peer[1]}")
        try:
            await self._read_requests(reader, writer)
        except (ConnectionError, TimeoutError, ssl.SSLError):
            pass
        finally:
            self._connections.discard(writer)
            writer.close()
            for synthesizer in list(self._channels.values()):
                synthesizer.connection_lost(writer)
            log.info("mrcp_connection_closed", source=f"{peer[0]}:{peer[1]}")

    async def _read_requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = bytearray()
        send = self._sender(writer)
        while True:
            data = await asyncio.wait_for(reader.read(_READ_BYTES), self.settings.idle_timeout_s)
            if not data:
                return
            buffer += data
            taken = 0
            while buffer:
                taken += 1
                if taken % _MESSAGES_PER_TURN == 0:
                    await asyncio.sleep(0)
                try:
                    framed = read_request(buffer, self.settings.max_message_bytes)
                except MessageError as exc:
                    self._refuse(exc, send)
                    if exc.length is None:
                        return  # no length to trust: the stream cannot be framed any further
                    del buffer[:exc.length]
                    continue
                if framed is None:
                    break
                request, length = framed
                del buffer[:length]
                self._dispatch(request, send, writer)
            if writer.is_closing():
                return

    def _dispatch(self, request, send: Callable[[bytes], None], connection: object) -> None:
        channel = request.channel
        if channel is None:
            self._refuse(MessageError(MANDATORY_HEADER_MISSING, "no Channel-Identifier (§6.2.1)",
                                      request.request_id, 0), send)
            return
        synthesizer = self._channels.get(channel)
        if synthesizer is None:
            self._refuse(MessageError(RESOURCE_NOT_ALLOCATED, f"no channel {channel[:80]!r} in any session",
                                      request.request_id, 0, channel), send)
            return
        try:
            synthesizer.handle(request, send, connection)
        except Exception:  # one channel's bug must not end the connection other channels share
            log.exception("mrcp_request_failed", channel=channel, method=request.method[:20])

    def _refuse(self, error: MessageError, send: Callable[[bytes], None]) -> None:
        metrics.mrcp_malformed_total.inc()
        log.info("mrcp_message_refused", status=error.status, reason=error.reason[:160])
        headers = (("Channel-Identifier", error.channel),) if error.channel else ()
        send(MrcpResponse(error.request_id, error.status, "COMPLETE", headers).serialize())

    def _sender(self, writer: asyncio.StreamWriter) -> Callable[[bytes], None]:
        def send(data: bytes) -> None:
            if writer.is_closing():
                return
            if writer.transport.get_write_buffer_size() > _MAX_UNSENT_BYTES:
                log.warning("mrcp_connection_not_reading", unsent=writer.transport.get_write_buffer_size())
                writer.close()
                return
            writer.write(data)
        return send

    def _allowed(self, host: str) -> bool:
        networks = self._allowed_sources()
        if not networks:
            return True
        address = ipaddress.ip_address(host.split("%", 1)[0])
        return any(address in network for network in networks)
