"""TCP limits with real sockets: connection caps (total, per source), the allow-list at accept, idle
and read (slowloris) timeouts, the message size bound (413) and byte-at-a-time framing."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest

from gateway import metrics
from gateway.sip.message import parse
from gateway.sip.transport import StreamLimits
from tests.gateway.sip.peers import raw_request

pytestmark = pytest.mark.timeout(20)


def _counter(name: str, reason: str) -> float:
    return metrics.registry.get_sample_value(name, {"reason": reason}) or 0.0


def _tcp_request(method: str, port: int, **kwargs) -> bytes:
    return raw_request(method, port, **kwargs).replace(b"SIP/2.0/UDP", b"SIP/2.0/TCP")


async def _connect(server, source: str = "127.0.0.1"):
    return await asyncio.open_connection(*server.tcp_address, local_addr=(source, 0))


async def _closed_by_server(reader: asyncio.StreamReader, timeout: float = 3.0) -> bool:
    """True when the gateway closes (EOF or reset) before `timeout`."""
    try:
        return await asyncio.wait_for(reader.read(65536), timeout) == b""
    except ConnectionResetError:
        return True


async def _options_ok(reader, writer, cseq: int = 1) -> bool:
    port = writer.get_extra_info("sockname")[1]
    writer.write(_tcp_request("OPTIONS", port, call_id=f"ok-{port}-{cseq}", cseq=cseq, branch=f"z9hG4bK-{port}-{cseq}"))
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    return parse(head, stream=True).status == 200


async def test_connection_caps_per_source_and_in_total(make_server):
    limits = StreamLimits(max_connections=5, max_connections_per_source=3)
    server, _ = await make_server(stream_limits=limits)
    per_source_before = _counter("gateway_sip_tcp_refused_total", "max_connections_per_source")
    total_before = _counter("gateway_sip_tcp_refused_total", "max_connections")
    kept = [await _connect(server) for _ in range(3)]
    for reader, writer in kept:
        assert await _options_ok(reader, writer)
    reader, _ = await _connect(server)  # a fourth from the same source
    assert await _closed_by_server(reader)
    kept += [await _connect(server, "127.0.0.2") for _ in range(2)]
    reader, _ = await _connect(server, "127.0.0.3")  # a sixth in total
    assert await _closed_by_server(reader)
    assert _counter("gateway_sip_tcp_refused_total", "max_connections_per_source") == per_source_before + 1
    assert _counter("gateway_sip_tcp_refused_total", "max_connections") == total_before + 1
    for reader, writer in kept:  # the admitted ones still work
        assert await _options_ok(reader, writer, cseq=2)
    kept[0][1].close()  # closing one makes room again
    await _closed_by_server(kept[0][0])
    for _ in range(50):
        if server._transport.connection_count < 5:
            break
        await asyncio.sleep(0.01)  # connection_lost runs on the gateway's side of the same loop
    reader, writer = await _connect(server, "127.0.0.3")
    assert await _options_ok(reader, writer)


async def test_allow_list_applies_at_accept(make_server):
    server, _ = await make_server(allowed_sources=(ipaddress.ip_network("127.0.0.2/32"),))
    before = _counter("gateway_sip_tcp_refused_total", "not_allowed")
    reader, writer = await _connect(server, "127.0.0.1")
    writer.write(_tcp_request("OPTIONS", 5060))  # never read: the connection is gone before it
    assert await _closed_by_server(reader)
    assert _counter("gateway_sip_tcp_refused_total", "not_allowed") == before + 1
    reader, writer = await _connect(server, "127.0.0.2")
    assert await _options_ok(reader, writer)


async def test_idle_connection_is_closed(make_server):
    server, _ = await make_server(stream_limits=StreamLimits(idle_timeout_s=0.2))
    before = _counter("gateway_sip_tcp_closed_total", "idle_timeout")
    reader, writer = await _connect(server)
    assert await _options_ok(reader, writer)  # in use, then silent
    assert await _closed_by_server(reader)
    assert _counter("gateway_sip_tcp_closed_total", "idle_timeout") == before + 1


async def test_slowloris_is_closed_by_the_read_timeout(make_server):
    """Bytes keep coming (so the idle timer never fires) but the message never completes."""
    server, _ = await make_server(stream_limits=StreamLimits(idle_timeout_s=5.0, read_timeout_s=0.3))
    before = _counter("gateway_sip_tcp_closed_total", "read_timeout")
    reader, writer = await _connect(server)
    data = _tcp_request("OPTIONS", 5060)
    closed = asyncio.create_task(_closed_by_server(reader))
    for byte in data[:-4]:
        if closed.done():
            break
        try:
            writer.write(bytes([byte]))
            await writer.drain()
        except ConnectionError:
            break
        await asyncio.sleep(0.02)  # the slow client's pace, not the gateway's
    assert await closed
    assert _counter("gateway_sip_tcp_closed_total", "read_timeout") == before + 1


async def test_message_larger_than_the_limit_gets_413_and_close(make_server):
    server, _ = await make_server(stream_limits=StreamLimits(max_message_bytes=4096))
    reader, writer = await _connect(server)
    head = _tcp_request("INVITE", 5060).replace(b"Content-Length: 0", b"Content-Length: 1000000")
    writer.write(head + b"x" * 1000)
    response = parse(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2), stream=True)
    assert response.status == 413 and response.call_id == "raw-call-1"
    assert await _closed_by_server(reader)
    # A header section that never ends is cut at the same bound, without an answer.
    reader, writer = await _connect(server)
    writer.write(b"OPTIONS sip:1000@127.0.0.1 SIP/2.0\r\nX-Pad: " + b"p" * 5000)
    assert await _closed_by_server(reader)


async def test_conflicting_content_length_on_a_stream_gets_400_and_close(make_server):
    server, _ = await make_server()
    reader, writer = await _connect(server)
    data = _tcp_request("OPTIONS", 5060).replace(b"Content-Length: 0", b"Content-Length: 0\r\nl: 5") + b"hello"
    writer.write(data)
    response = parse(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2), stream=True)
    assert response.status == 400 and "Content-Length" in (response.header("Warning") or "")
    assert await _closed_by_server(reader)


async def test_message_sent_one_byte_at_a_time_is_framed(make_server):
    """The blank-line search resumes where it stopped; the boundary split in every way still works."""
    server, _ = await make_server()
    reader, writer = await _connect(server)
    port = writer.get_extra_info("sockname")[1]
    for n, body in enumerate((b"", b"v=0\r\n")):
        data = _tcp_request("OPTIONS", port, cseq=n + 1, branch=f"z9hG4bK-b{n}")
        if body:
            data = data.replace(b"Content-Length: 0", b"Content-Type: application/x\r\nContent-Length: 5") + body
        for byte in data:
            writer.write(bytes([byte]))
            await writer.drain()
        response = parse(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2), stream=True)
        assert response.status == 200 and response.cseq == (n + 1, "OPTIONS")


async def test_busy_pipelined_peer_is_not_mistaken_for_slowloris(make_server):
    """Reads that always end mid-message are fine while messages keep completing."""
    server, _ = await make_server(stream_limits=StreamLimits(read_timeout_s=0.3))
    reader, writer = await _connect(server)
    port = writer.get_extra_info("sockname")[1]
    messages = b"".join(_tcp_request("OPTIONS", port, cseq=n, branch=f"z9hG4bK-p{n}") for n in range(1, 13))
    step = len(messages) // 12 + 7  # each write completes one message and starts the next
    for start in range(0, len(messages), step):
        writer.write(messages[start:start + step])
        await writer.drain()
        await asyncio.sleep(0.1)  # 12 writes over 1.2 s: four read timeouts' worth, never one message's
    for n in range(1, 13):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        assert parse(head, stream=True).cseq == (n, "OPTIONS")
