"""SIP TCP peers that abuse the stream, with real sockets (issue #31 item 2): keep-alives are answered
within the source's budget and a flood of them closes the connection; a peer that never reads its
responses is closed when they pile up; a pipelined batch is handled a few messages per loop turn. After
each, a normal request from an honest peer is still answered."""

from __future__ import annotations

import asyncio
import socket

import pytest

from gateway import metrics
from gateway.sip.message import parse
from gateway.sip.rate_limit import FloodLimits
from gateway.sip.transport import StreamLimits
from tests.gateway.sip.peers import raw_request

pytestmark = pytest.mark.timeout(20)

UNLIMITED = FloodLimits(per_source_per_s=1e6, total_per_s=1e6)


def _counter(name: str, reason: str) -> float:
    return metrics.registry.get_sample_value(name, {"reason": reason}) or 0.0


def _tcp_request(method: str, port: int, **kwargs) -> bytes:
    return raw_request(method, port, **kwargs).replace(b"SIP/2.0/UDP", b"SIP/2.0/TCP")


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 5.0) -> bool:
    try:
        while True:  # pongs or responses sent before the close are read past
            if await asyncio.wait_for(reader.read(65536), timeout) == b"":
                return True
    except ConnectionResetError:
        return True


async def _honest_options(server, source: str = "127.0.0.3") -> int:
    reader, writer = await asyncio.open_connection(*server.tcp_address, local_addr=(source, 0))
    port = writer.get_extra_info("sockname")[1]
    writer.write(_tcp_request("OPTIONS", port, call_id=f"honest-{port}", branch=f"z9hG4bK-h{port}"))
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
    writer.close()
    return parse(head, stream=True).status


def _rss_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_keepalive_ping_gets_a_pong_and_the_connection_stays(make_server):
    server, _ = await make_server()
    reader, writer = await asyncio.open_connection(*server.tcp_address)
    for _ in range(3):  # RFC 5626 §3.5.1: CRLFCRLF -> CRLF
        writer.write(b"\r\n\r\n")
        assert await asyncio.wait_for(reader.readexactly(2), 2) == b"\r\n"
    port = writer.get_extra_info("sockname")[1]
    writer.write(_tcp_request("OPTIONS", port))  # the same connection still carries requests
    assert parse(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2), stream=True).status == 200


async def test_keepalive_flood_from_a_peer_that_never_reads_is_closed(make_server):
    """Before: every CRLFCRLF was answered before any budget, at 100 % CPU, and the pongs piled up."""
    server, _ = await make_server(flood=FloodLimits(per_source_per_s=50))  # burst 100 pings
    closed_before = _counter("gateway_sip_tcp_closed_total", "keepalive_flood")
    refused_before = _counter("gateway_sip_tcp_refused_total", "over_budget")
    rss_before = _rss_kib()
    flooder = socket.create_connection(server.tcp_address, source_address=("127.0.0.2", 0))
    flooder.setblocking(False)
    sent = 0
    with pytest.raises(OSError):  # the gateway resets the connection: the flooder's sends start failing
        for _ in range(20_000):
            try:
                sent += flooder.send(b"\r\n\r\n" * 16384)
            except BlockingIOError:
                pass
            await asyncio.sleep(0)  # the gateway shares this loop
    flooder.close()
    assert sent < 64 << 20
    assert _counter("gateway_sip_tcp_closed_total", "keepalive_flood") == closed_before + 1
    assert _rss_kib() - rss_before < 16 * 1024  # no pong buffer growing without bound
    # The same source, over its budget, does not get a fresh connection to flood again at once ...
    reader, _ = await asyncio.open_connection(*server.tcp_address, local_addr=("127.0.0.2", 0))
    assert await _closed_by_server(reader)
    assert _counter("gateway_sip_tcp_refused_total", "over_budget") == refused_before + 1
    # ... while an honest peer is served, and the gateway keeps no connection of the flooder.
    assert await _honest_options(server) == 200
    assert all(address[0] != "127.0.0.2" for address in server._transport._connections)


async def test_peer_that_never_reads_its_responses_is_closed(make_server):
    limits = StreamLimits(max_unsent_bytes=16384)
    server, _ = await make_server(flood=UNLIMITED, stream_limits=limits)
    before = _counter("gateway_sip_tcp_closed_total", "unread")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small window
    sock.bind(("127.0.0.2", 0))
    sock.connect(server.tcp_address)
    _, writer = await asyncio.open_connection(sock=sock)
    port = sock.getsockname()[1]
    batch = b"".join(_tcp_request("OPTIONS", port, call_id=f"unread-{n}", branch=f"z9hG4bK-u{n}") for n in range(500))
    with pytest.raises(ConnectionError):  # the gateway closes: writing fails
        for _ in range(200):  # up to 100,000 requests (~35 MB of responses), none of them read
            writer.write(batch)
            await asyncio.wait_for(writer.drain(), 5)
    writer.close()
    assert _counter("gateway_sip_tcp_closed_total", "unread") == before + 1
    assert await _honest_options(server) == 200


def _options_handled() -> float:
    return metrics.registry.get_sample_value("gateway_sip_requests_total", {"method": "OPTIONS"}) or 0.0


async def test_pipelined_batch_is_handled_a_few_messages_per_loop_turn(make_server):
    """2,000 requests in one write: all answered, in order, and never more than a few between two turns
    of the loop (before: a whole read, hundreds of messages, in one callback while the packet clock waited)."""
    server, _ = await make_server(flood=UNLIMITED)
    reader, writer = await asyncio.open_connection(*server.tcp_address)
    port = writer.get_extra_info("sockname")[1]
    most_per_turn, last = 0.0, _options_handled()
    done = asyncio.Event()

    def tick() -> None:  # stands for the packet clock: one callback per loop turn
        nonlocal most_per_turn, last
        handled = _options_handled()
        most_per_turn, last = max(most_per_turn, handled - last), handled
        if not done.is_set():
            asyncio.get_running_loop().call_soon(tick)

    asyncio.get_running_loop().call_soon(tick)
    writer.write(b"".join(_tcp_request("OPTIONS", port, call_id=f"pipe-{n}", cseq=n, branch=f"z9hG4bK-p{n}")
                          for n in range(1, 2001)))
    for n in range(1, 2001):
        response = parse(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5), stream=True)
        assert (response.status, response.cseq) == (200, (n, "OPTIONS"))
    done.set()
    assert 1 <= most_per_turn <= 8
    writer.close()
    assert await _honest_options(server) == 200
