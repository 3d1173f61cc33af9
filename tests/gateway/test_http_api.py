"""HTTP API over real loopback: Prometheus text on /metrics, 200/503 on /healthz."""

from __future__ import annotations

import aiohttp
import pytest

from gateway import metrics
from gateway.http_api import start_http, stop_http


@pytest.fixture
async def served():
    state = {"status": "ok", "engine": "espeak", "calls_active": 2, "draining": False}
    server = await start_http(lambda: dict(state), "127.0.0.1", 0)
    async with aiohttp.ClientSession(f"http://127.0.0.1:{server.port}") as session:
        yield state, session
    await stop_http(server)


async def test_metrics_are_prometheus_text_with_gateway_metrics(served):
    _, session = served
    metrics.sip_requests_total.labels(method="INVITE").inc()
    async with session.get("/metrics") as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        body = await response.text()
    assert "# TYPE gateway_calls_active gauge" in body
    assert 'gateway_sip_requests_total{method="INVITE"}' in body
    assert "gateway_first_packet_latency_seconds_bucket" in body


async def test_healthz_is_200_while_serving_and_503_while_draining(served):
    state, session = served
    async with session.get("/healthz") as response:
        assert response.status == 200
        assert await response.json() == {"status": "ok", "engine": "espeak", "calls_active": 2, "draining": False}
    state.update(status="draining", draining=True)
    async with session.get("/healthz") as response:
        assert response.status == 503
        assert (await response.json())["draining"] is True


async def test_start_reports_the_bound_port_and_stop_frees_it():
    server = await start_http(lambda: {"draining": False}, "127.0.0.1", 0)
    assert server.port > 0 and server.host == "127.0.0.1"
    await stop_http(server)
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientConnectionError):
            await session.get(f"http://127.0.0.1:{server.port}/healthz")
