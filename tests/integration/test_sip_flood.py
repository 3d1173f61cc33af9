"""SIP abuse against the real `serve` process (issue #31 items 2 and 4), with its resources read from /proc:
a keep-alive flood over TCP from a peer that never reads is closed and leaves RSS and descriptors flat; a
flood spread over 50 source addresses with junk carrying the trunk's address meets the total budget. After
each, a real call (SIPp: INVITE, 200, ACK, the prompt's RTP, BYE) still works."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from pathlib import Path

import pytest
import yaml

from integration_harness import options_status, rtp_recorder, run_sipp
from serve_process import ServeProcess, start_serve

pytestmark = [pytest.mark.timeout(90)]
SCENARIOS = Path(__file__).resolve().parent / "sipp"


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def _start(tmp_path: Path) -> ServeProcess:
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({
        "sip": {"t1_ms": 50}, "trunks": [{"name": "pbx", "allow": ["127.0.0.0/8"]}],
        "engine": {"name": "instant"}, "routes": [{"match": "1000", "text": "hello"}],
        "shutdown": {"drain_timeout_s": 1}}))
    gateway = await start_serve(tmp_path, config, "sip.transports=[udp,tcp]")
    await gateway.wait_healthy()
    return gateway


async def _a_call_works(gateway: ServeProcess, workdir: Path) -> None:
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip_address, workdir, keys={
        "text": "still here", "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    assert recorder.packets


def _crlf_flood(address: tuple[str, int], limit_bytes: int) -> tuple[int, bool]:
    """CRLFCRLF pings as fast as the socket takes them, never reading; (bytes sent, closed by the gateway)."""
    with socket.create_connection(address, source_address=("127.0.0.2", 0)) as s:
        s.settimeout(5)
        sent = 0
        try:
            while sent < limit_bytes:
                sent += s.send(b"\r\n\r\n" * 16384)
        except OSError:
            return sent, True
        return sent, False


async def test_keepalive_flood_over_tcp_is_closed_and_leaves_resources_flat(tmp_path):
    """Before: every ping was answered at 100 % CPU, RSS grew 3.2 MB/s and the live calls' RTP stalled."""
    gateway = await _start(tmp_path)
    try:
        pid = gateway.process.pid
        await _a_call_works(gateway, tmp_path)
        rss_before, fds_before = _rss_kib(pid), _fds(pid)
        sent, closed = await asyncio.to_thread(_crlf_flood, gateway.sip_address, 64 << 20)
        assert closed, f"{sent} bytes of keep-alives and the connection is still open"
        await asyncio.sleep(0.2)  # the gateway's side of the close
        assert _rss_kib(pid) - rss_before < 8 * 1024
        assert _fds(pid) <= fds_before
        assert (await options_status(gateway.sip_address)).startswith("SIP/2.0 200")
        await _a_call_works(gateway, tmp_path)
    finally:
        await gateway.stop()


def _spread_flood(address: tuple[str, int], count: int) -> dict[str, int]:
    """`count` INVITEs round robin over 50 sources, with 300 junk datagrams from 127.0.0.1 among them;
    the status codes that came back."""
    sockets = []
    for i in range(50):
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.bind((f"127.0.0.{10 + i}", 0))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sockets.append(s)
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    junk.bind(("127.0.0.1", 0))
    for n in range(count):
        s = sockets[n % 50]
        host, port = s.getsockname()
        s.sendto((f"INVITE sip:9999@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/UDP {host}:{port};branch=z9hG4bK-m{n};rport\r\n"
                  f"From: <sip:m@{host}>;tag=m{n}\r\nTo: <sip:9999@127.0.0.1>\r\nCall-ID: m{n}\r\n"
                  f"CSeq: 1 INVITE\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n").encode(), address)
        if n % 7 == 0:
            junk.sendto(os.urandom(200), address)
        if n % 50 == 49:
            time.sleep(0.005)  # ~2,000 a second, the load of the flood
    codes: dict[str, int] = {}
    deadline = time.monotonic() + 1.5
    for s in sockets:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while True:
                code = s.recv(65535)[8:11].decode()
                codes[code] = codes.get(code, 0) + 1
        except TimeoutError:
            pass
        s.close()
    junk.close()
    return codes


async def test_flood_over_50_sources_meets_the_total_budget(tmp_path):
    """Before: 2,000 INVITE/s over 50 addresses were all admitted (~1 core, +55 MB that stayed)."""
    gateway = await _start(tmp_path)
    try:
        pid = gateway.process.pid
        rss_before = _rss_kib(pid)
        started = time.monotonic()
        codes = await asyncio.to_thread(_spread_flood, gateway.sip_address, 3000)
        elapsed = time.monotonic() - started
        # sip.flood.max_requests_per_s 500, burst 1,000: each admitted INVITE gets one 100 (and a 404,
        # retransmitted until an ACK that never comes)
        admitted = codes.get("100", 0)
        assert 0 < admitted <= 1000 + 500 * elapsed, (codes, elapsed)
        assert codes.get("503", 0) <= 100 + 50 * elapsed  # cheap 503s bounded in total, whatever the sources
        assert _rss_kib(pid) - rss_before < 32 * 1024
        assert (await options_status(gateway.sip_address)).startswith("SIP/2.0 200")
        await _a_call_works(gateway, tmp_path)
    finally:
        await gateway.stop()
