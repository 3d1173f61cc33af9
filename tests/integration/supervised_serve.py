"""`cosyvoice-gateway serve` with supervised engine workers, as operators run it: a subprocess on free loopback
ports with its config in a file, its /healthz, /metrics, log and worker children; and SIPp callers that listen
until the gateway's BYE, with the RTP they heard."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np
import yaml
from integration_harness import SCENARIOS, free_udp_port, rtp_recorder, run_sipp

REPO = Path(__file__).resolve().parents[2]


def free_tcp_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Serve:
    """`cosyvoice-gateway serve` in a subprocess, its address, its /healthz and its worker children."""

    def __init__(self, process: asyncio.subprocess.Process, sip_port: int, http_port: int, log_path: Path) -> None:
        self.process = process
        self.sip = ("127.0.0.1", sip_port)
        self.http = f"http://127.0.0.1:{http_port}"
        self.log_path = log_path

    async def healthz(self) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.get(f"{self.http}/healthz") as response:
            return response.status, await response.json()

    async def metric(self, name: str) -> float:
        async with aiohttp.ClientSession() as session, session.get(f"{self.http}/metrics") as response:
            body = await response.text()
        return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                   if line.startswith(name + " ") or line.startswith(name + "{"))

    async def until_healthy(self, timeout: float = 90.0, slots_free: int | None = None) -> dict:
        return await self.until(lambda status, body: status == 200 and (
            slots_free is None or body.get("slots_free") == slots_free), timeout)

    async def until_workers_ready(self, count: int, timeout: float = 60.0) -> dict:
        """Until /healthz counts `count` workers ready (healthy or not: a gateway whose slots are all taken is 503)."""
        return await self.until(lambda _status, body: body.get("workers_ready") == count, timeout)

    async def until(self, condition, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.returncode is None, "serve exited"
            try:
                status, body = await self.healthz()
                if condition(status, body):
                    return body
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)  # polling the operator's endpoint, as a balancer would
        raise TimeoutError(f"/healthz never said so; last: {await self.healthz()}")

    def workers(self) -> list[int]:
        children = Path(f"/proc/{self.process.pid}/task/{self.process.pid}/children")
        pids = [int(pid) for pid in children.read_text().split()] if children.exists() else []
        return [pid for pid in pids if b"engine_service" in Path(f"/proc/{pid}/cmdline").read_bytes()]

    def log_events(self, name: str | None = None) -> list[dict]:
        events = [json.loads(line) for line in self.log_path.read_text(errors="replace").splitlines()
                  if line.startswith("{")]
        return [event for event in events if name is None or event.get("event") == name]


async def start_serve(tmp_path: Path, engine: dict, log_level: str = "info", extra: dict | None = None,
                      env: dict[str, str] | None = None, cwd: Path = REPO) -> Serve:
    """`serve` with this engine block (and more config in `extra`), its log in tmp_path/serve.log; returns at once."""
    sip_port, http_port = free_udp_port(), free_tcp_port()
    config = {"sip": {"listen": f"127.0.0.1:{sip_port}", "transports": ["udp"], "t1_ms": 50},
              "media": {"rtp_port_range": "43000-44999"}, "engine": engine,
              "http": {"listen": f"127.0.0.1:{http_port}"}, "logging": {"level": log_level},
              "shutdown": {"drain_timeout_s": 20}, **(extra or {})}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    log_path = tmp_path / "serve.log"
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        stdout=asyncio.subprocess.DEVNULL, stderr=log_path.open("w"))
    return Serve(process, sip_port, http_port, log_path)


async def stop_serve(serve: Serve) -> None:
    if serve.process.returncode is None:
        serve.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(serve.process.wait(), 30)
        except asyncio.TimeoutError:
            serve.process.kill()
            await serve.process.wait()


async def listening_call(serve: Serve, tmp_path: Path, text: str, name: str, timeout_s: int = 60):
    """A SIPp call that listens until the gateway's BYE; returns (task -> (rc, errors, ended_at), recorder)."""
    recorder = await rtp_recorder()
    workdir = tmp_path / name
    workdir.mkdir()

    async def run():
        rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", serve.sip, workdir, timeout_s=timeout_s, keys={
            "text": text, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
        return rc, errors, time.monotonic()

    return asyncio.create_task(run()), recorder


def speech_level(recorder) -> float:
    """RMS of the PCMU audio a call received (0 for none): speech is well above 300."""
    audio = recorder.audio("PCMU").astype(np.float64)
    return float(np.sqrt(np.mean(audio**2))) if audio.size else 0.0
