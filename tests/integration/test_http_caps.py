"""The gateway's HTTP port under a flood of idle and half-sent connections (issue 31, item 3): `serve` as operators
run it, raw sockets from one loopback address for the flood, /healthz and a SIP call from another."""

from __future__ import annotations

import asyncio
import socket

from integration_harness import invite_final_response
from serve_process import start_serve
from tests.peer_sockets import closed_by_peer, open_fds

FLOODER = "127.0.0.2"  # another loopback source: the per-source cap is what the flood meets


def _connect_from(source: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


async def test_idle_flood_beyond_the_caps_is_refused_while_healthz_and_calls_go_on(tmp_path):
    serve = await start_serve(tmp_path, None, "http.max_connections=40", "http.max_connections_per_source=20",
                              "http.header_timeout_s=60", "engine.instant.ms_per_char=5",
                              "media.inactivity_timeout_s=0", "shutdown.drain_timeout_s=1", engine="instant")
    try:
        await serve.wait_healthy()
        pid = serve.process.pid
        fds_before, rss_before = open_fds(pid), _rss_kb(pid)
        flood = [_connect_from(FLOODER, serve.http_port) for _ in range(100)]
        try:
            await asyncio.sleep(0.3)
            refused = sum(closed_by_peer(sock, 0.05) for sock in flood)
            assert refused == 80  # 20 held (the per-source cap), 80 aborted at accept
            assert open_fds(pid) <= fds_before + 20 + 2
            status, body = await serve.healthz()  # from 127.0.0.1: its own share of the total
            assert status == 200 and body["healthy"]
            assert (await invite_final_response(serve.sip_address, {"X-TTS-Text": "Still here."})) == \
                "SIP/2.0 200 OK"
        finally:
            for sock in flood:
                sock.close()
        for _ in range(50):  # the held ones give their descriptors back as they close
            if open_fds(pid) <= fds_before + 2:
                break
            await asyncio.sleep(0.1)
        assert open_fds(pid) <= fds_before + 2
        assert _rss_kb(pid) - rss_before < 4096  # a flood leaves no memory behind (kB)
        status, metrics = await _get(serve.http_port, "/metrics")
        assert 'gateway_http_connections_refused_total{reason="max_connections_per_source"} 80.0' in metrics
    finally:
        assert await serve.stop() == 0


async def test_a_half_sent_request_head_is_closed_after_the_header_timeout(tmp_path):
    serve = await start_serve(tmp_path, None, "http.header_timeout_s=1", engine="instant")
    try:
        await serve.wait_healthy()
        slow = _connect_from(FLOODER, serve.http_port)
        try:
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")  # a byte more now and then, never done
            assert not closed_by_peer(slow, 0.3)
            slow.sendall(b"a")
            assert closed_by_peer(slow, 5)
        finally:
            slow.close()
        status, metrics = await _get(serve.http_port, "/metrics")
        assert 'gateway_http_connections_closed_total{reason="header_timeout"} 1.0' in metrics
        assert (await serve.healthz())[0] == 200
    finally:
        assert await serve.stop() == 0


async def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(tmp_path):
    serve = await start_serve(tmp_path, None, "http.idle_timeout_s=1", engine="instant")
    try:
        await serve.wait_healthy()
        idle = _connect_from(FLOODER, serve.http_port)
        try:
            idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive (HTTP/1.1), then silence
            idle.settimeout(5)  # the answer, then the end of the connection, well before 5 s
            answer = b""
            while chunk := idle.recv(4096):
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
        finally:
            idle.close()
    finally:
        assert await serve.stop() == 0


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


async def _get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode(errors="replace")
