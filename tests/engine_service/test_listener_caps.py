"""A worker's port under a flood of idle and half-sent connections (issue 31, item 3): a real worker process,
raw sockets for the flood, and the gateway's own client (RemoteEngine) for the link that must still get in."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from engines.base import SynthesisRequest
from engines.remote import RemoteEngine
from tests.peer_sockets import closed_by_peer, open_fds

REPO = Path(__file__).resolve().parents[2]
TOKEN = "link-token-0123456789"
LIMITS = {"max_connections": 20, "max_connections_per_source": 20, "idle_timeout_s": 30, "header_timeout_s": 1.0,
          "link_reserve": 4}


@pytest.fixture
def worker(request):
    param = dict(getattr(request, "param", {}))
    nofile = param.pop("nofile", None)
    limits = {**LIMITS, **param}

    def lower_nofile() -> None:
        if nofile is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    process = subprocess.Popen(
        [sys.executable, "-m", "engine_service", "--engine", "instant", "--listen", "127.0.0.1:0",
         "--token-file", "-", "--http-limits", json.dumps(limits)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, preexec_fn=lower_nofile)
    process.stdin.write(TOKEN + "\n")
    process.stdin.flush()
    url = json.loads(process.stdout.readline())["url"]
    yield process, url
    process.terminate()
    process.wait(timeout=30)


def _flood(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        socks.append(sock)
    return socks


async def _metric(base: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


# A header timeout longer than the test: the link gets in through the reserve, not because the flood timed out.
@pytest.mark.parametrize("worker", [{"header_timeout_s": 60}], indirect=True)
async def test_idle_flood_is_capped_and_the_gateway_link_still_gets_in(worker):
    process, url = worker
    base = url.split("/v1/")[0].replace("ws://", "http://")
    port = int(base.rsplit(":", 1)[1])
    fds_before = open_fds(process.pid)
    socks = _flood(port, 60)  # 3x the cap, none sends a byte
    try:
        await asyncio.sleep(0.3)
        refused = sum(closed_by_peer(sock, 0.05) for sock in socks)
        # 20 admitted and 4 on the links' reserve stay open (until the header timeout); the other 36 are closed
        assert refused >= 60 - 20 - LIMITS["link_reserve"]
        assert open_fds(process.pid) <= fds_before + 20 + LIMITS["link_reserve"] + 2

        # the gateway's client connects while the flood is held
        engine = RemoteEngine([url], token=TOKEN, engine_name="instant", default_voice="default")
        await engine.start()
        try:
            for _ in range(60):
                if engine.health().state == "ready":
                    break
                await asyncio.sleep(0.05)
            assert engine.health().state == "ready"
            channel = engine.open_stream(SynthesisRequest(text="Still speaking.", voice="en"))
            await channel.admitted()
            assert sum([len(chunk) async for chunk in channel]) > 0
        finally:
            await engine.close()
    finally:
        for sock in socks:
            sock.close()
    # /healthz answers once the flood is gone, and the port holds no more descriptors than before it
    async with aiohttp.ClientSession() as session, session.get(f"{base}/healthz") as response:
        assert response.status == 200
    # past the caps, each newcomer took the reserve place of the oldest connection that had not shown the token
    assert await _metric(base, 'tts_worker_http_connections_closed_total{reason="evicted"}') >= 36
    for _ in range(50):
        if open_fds(process.pid) <= fds_before + 1:
            break
        await asyncio.sleep(0.1)
    assert open_fds(process.pid) <= fds_before + 1


async def test_a_half_sent_request_head_is_closed_after_the_header_timeout(worker):
    process, url = worker
    base = url.split("/v1/")[0].replace("ws://", "http://")
    port = int(base.rsplit(":", 1)[1])
    slow = socket.create_connection(("127.0.0.1", port))
    try:
        slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")  # never the blank line
        assert closed_by_peer(slow, LIMITS["header_timeout_s"] + 5)
    finally:
        slow.close()
    assert await _metric(base, 'tts_worker_http_connections_closed_total{reason="header_timeout"}') >= 1


async def test_a_stranger_on_the_links_reserve_is_closed_without_the_token(worker):
    process, url = worker
    base = url.split("/v1/")[0].replace("ws://", "http://")
    port = int(base.rsplit(":", 1)[1])
    socks = _flood(port, LIMITS["max_connections"])
    try:
        await asyncio.sleep(0.2)
        stranger = socket.create_connection(("127.0.0.1", port))  # past the cap: on probation
        stranger.sendall("GET /v1/engine/stream?version=1 HTTP/1.1\r\nHost: x\r\n"
                         "Authorization: Bearer wrong-token\r\n\r\n".encode())
        assert closed_by_peer(stranger, 5)
        stranger.close()
    finally:
        for sock in socks:
            sock.close()
    assert await _metric(base, 'tts_worker_http_connections_closed_total{reason="untrusted"}') >= 1


# A file limit far below the caps: the descriptor budget refuses at accept; accepts that still fail with EMFILE (a
# burst is accepted before any of it is judged) are counted and logged once per 10 s, never a traceback each,
# and the worker serves once the flood ends.
@pytest.mark.parametrize("worker", [{"nofile": 256, "max_connections": 1000, "max_connections_per_source": 1000,
                                     "header_timeout_s": 60}], indirect=True)
async def test_a_flood_past_the_file_limit_is_refused_without_tracebacks(worker):
    process, url = worker
    base = url.split("/v1/")[0].replace("ws://", "http://")
    port = int(base.rsplit(":", 1)[1])
    socks = _flood(port, 300)
    try:
        await asyncio.sleep(0.5)
        assert open_fds(process.pid) < 256
    finally:
        for sock in socks:
            sock.close()
    await asyncio.sleep(0.3)
    async with aiohttp.ClientSession() as session, session.get(f"{base}/healthz") as response:
        assert response.status == 200
    assert await _metric(base, 'tts_worker_http_connections_refused_total{reason="descriptors"}') > 0
    accept_errors = await _metric(base, "tts_worker_accept_errors_total")
    process.terminate()
    process.wait(timeout=30)
    log = process.stderr.read()
    assert "Traceback" not in log
    assert log.count('"accept_failed"') <= 1 + int(accept_errors > 0)  # once per 10 s, however many failed
