"""The shipped Grafana dashboard and alert rules name series a real gateway and worker export.

A real Prometheus (Debian's `prometheus`) scrapes a real `cosyvoice-gateway serve` (espeak, one supervised
worker on a fixed port, the speech API on) every second while its worker hangs once (SIGSTOP: the gateway kills
it as hung and restarts it; a call placed meanwhile is refused 503), then in two rounds it takes calls from SIPp
(1, then 2 at once) and answers a speech API request. Then every dashboard query and every alert expression is
evaluated through Prometheus's HTTP API.

What "returns data" means here, honestly:
- dashboard queries: Grafana's `$__rate_interval` is replaced by `1m` (Prometheus has no such macro); each
  query must return at least one series with a value (a quantile of no observations would be NaN: refused);
- alert expressions: a healthy gateway does not fire them, so each is evaluated with its threshold comparisons
  (`> 0.1`, `== 0`) removed -- the series it compares must exist; the whole expression must also run
  without error (its result may be empty: nothing is wrong). `for:` durations are not waited for.
The rules' syntax is checked by `promtool check rules` in the same file.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "integration"))  # the integration tests' serve and SIPp helpers

from integration_harness import SIP_SCENARIOS, run_sipp  # noqa: E402
from supervised_serve import listening_call, start_serve, stop_serve  # noqa: E402

DASHBOARD = REPO / "deploy" / "grafana" / "cosyvoice-gateway.json"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yaml"
API_KEY = "ops-test-key-0123456789"

pytestmark = [
    pytest.mark.skipif(shutil.which("prometheus") is None or shutil.which("promtool") is None,
                       reason="needs Debian's prometheus package (scripts/bootstrap.sh installs it)"),
]

# A comparison against a number literal, with an optional `bool`: what an alert adds to the series it watches.
THRESHOLD = re.compile(r"\s*(==|!=|>=|<=|>|<)\s*(bool\s+)?-?[0-9.]+(e[+-]?[0-9]+)?(?![\w.])")


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(f"{panel['title']} [{target['refId']}]", target["expr"].replace("$__rate_interval", "1m"))
            for panel in panels for target in panel["targets"]]


def alert_rules() -> list[tuple[str, str]]:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [(rule["alert"], rule["expr"]) for group in groups for rule in group["rules"]]


def test_promtool_accepts_the_alert_rules() -> None:
    result = subprocess.run(["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_show_each_alert_fires_on_its_condition() -> None:
    """deploy/prometheus/alerts_test.yaml feeds series where each alert must fire and where it must not."""
    result = subprocess.run(["promtool", "test", "rules", "alerts_test.yaml"], cwd=ALERTS.parent,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    tested = set(re.findall(r"alertname:\s*(\w+)", (ALERTS.parent / "alerts_test.yaml").read_text()))
    assert tested == {name for name, _ in alert_rules()}, "every alert has a promtool unit test"


def test_thresholds_come_off_alert_expressions() -> None:
    assert THRESHOLD.sub("", "up{job=\"w\"} == 0 or max by (i) (s) == 0") == "up{job=\"w\"} or max by (i) (s)"
    assert THRESHOLD.sub("", "rate(x[5m]) / rate(y[5m]) > 0.01") == "rate(x[5m]) / rate(y[5m])"
    assert THRESHOLD.sub("", "histogram_quantile(0.95, z) > 1") == "histogram_quantile(0.95, z)"


def _free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _query(session: aiohttp.ClientSession, prometheus: str, expr: str) -> list[dict]:
    async with session.get(f"{prometheus}/api/v1/query", params={"query": expr}) as response:
        body = await response.json()
    assert body["status"] == "success", f"{expr}: {body}"
    return body["data"]["result"]


async def _until(session, prometheus: str, expr: str, timeout_s: float = 30.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if result := await _query(session, prometheus, expr):
                return result
        except aiohttp.ClientError:
            pass  # Prometheus still starting: not listening yet, or its API not serving JSON yet
        await asyncio.sleep(0.5)  # polling Prometheus's API as a dashboard would
    raise AssertionError(f"Prometheus never had {expr}")


@pytest.mark.sipp
@pytest.mark.timeout(240)
async def test_every_panel_and_alert_returns_data_from_a_real_gateway(tmp_path: Path) -> None:
    worker_port = _free_tcp_port()
    serve = await start_serve(tmp_path, {
        "name": "espeak", "workers": 1, "worker": {"port": worker_port, "dead_after_ms": 500},
    }, extra={"tts_api": {"api_keys": [{"name": "ops", "key": API_KEY, "max_streams": 4}]}})
    prom_port = _free_tcp_port()
    gateway_target = serve.http.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [
            {"job_name": "cosyvoice-gateway", "static_configs": [{"targets": [gateway_target]}]},
            {"job_name": "cosyvoice-worker", "static_configs": [{"targets": [f"127.0.0.1:{worker_port}"]}]},
        ],
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    prom_log = (tmp_path / "prometheus.log").open("w")
    prometheus = await asyncio.create_subprocess_exec(
        "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
        f"--web.listen-address=127.0.0.1:{prom_port}", stdout=prom_log, stderr=prom_log)
    prom_url = f"http://127.0.0.1:{prom_port}"
    try:
        await serve.until_healthy(timeout=90)
        async with aiohttp.ClientSession() as session:
            # Both targets scraped before anything happens, so every rate() has a sample from before.
            await _until(session, prom_url, 'sum(up{job=~"cosyvoice-gateway|cosyvoice-worker"}) == 2')
            # The worker hangs: the gateway kills it as hung and restarts it; a call meanwhile is refused 503.
            (worker_pid,) = serve.workers()
            os.kill(worker_pid, signal.SIGSTOP)
            await serve.until_workers_ready(0, timeout=30)
            busy = tmp_path / "busy"
            busy.mkdir()
            rc, errors = await run_sipp(SIP_SCENARIOS / "uac_busy.xml", serve.sip, busy)
            assert rc == 0, errors
            await serve.until_workers_ready(1, timeout=90)
            # The restarted worker scraped (its counters start again from 0) before the calls it will serve.
            await _until(session, prom_url, 'tts_worker_state{state="ready"} == 1')
            await _until(session, prom_url, "gateway_engine_worker_kills_total")
            await asyncio.sleep(2)
            # Calls that are answered and spoken, and speech API requests, in two rounds: a labelled series
            # (calls by outcome, API first byte by route) appears with its first event, and rate() sees an
            # increase only from the second on, as on any gateway Prometheus watches.
            for round_, texts in enumerate((["Hello from the dashboard test."],
                                            ["A second round.", "Two callers listen at once."])):
                calls = [await listening_call(serve, tmp_path, text, f"call{round_}-{i}")
                         for i, text in enumerate(texts)]
                for task, _recorder in calls:
                    rc, errors, _ = await task
                    assert rc == 0, errors
                async with session.post(
                        f"http://127.0.0.1:{worker_port}/v1/tts", headers={"Authorization": f"Bearer {API_KEY}"},
                        json={"text": "Hello from the speech API.", "format": "wav", "sample_rate": 16000}) as response:
                    assert response.status == 200, await response.text()
                    assert len(await response.read()) > 1000
                # Prometheus has scraped this round.
                await _until(session, prom_url, f"tts_api_first_byte_latency_seconds_count >= {round_ + 1}")
                await _until(session, prom_url, f"gateway_first_packet_latency_seconds_count >= {1 + 2 * round_}")
            await asyncio.sleep(2)  # two more scrapes: every counter's last increase is inside its rate window

            empty = []
            for name, expr in dashboard_queries():
                result = await _query(session, prom_url, expr)
                values = [float(series["value"][1]) for series in result]
                if not values or all(math.isnan(v) for v in values):
                    empty.append(f"panel {name}: {expr} -> {result}")
            for name, expr in alert_rules():
                await _query(session, prom_url, expr)  # the whole expression runs
                inner = THRESHOLD.sub("", expr)
                assert inner != expr, f"alert {name}: no threshold found to remove"
                if not await _query(session, prom_url, inner):
                    empty.append(f"alert {name}: {inner} -> no series")
            assert not empty, "queries that name no series:\n" + "\n".join(empty)
    finally:
        prometheus.terminate()
        await prometheus.wait()
        prom_log.close()
        await stop_serve(serve)
