"""`cosyvoice-gateway serve` as an operator runs it: a subprocess on free loopback ports, its log in a file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ServeProcess:
    process: asyncio.subprocess.Process
    sip_port: int
    http_port: int
    log_path: Path
    log_seen: int = field(default=0)

    @property
    def sip_address(self) -> tuple[str, int]:
        return ("127.0.0.1", self.sip_port)

    def _log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_events(self) -> list[dict]:
        events = []
        for line in self._log_text().splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a traceback or another non-JSON line
        return events

    async def wait_for_event(self, name: str, timeout_s: float = 30.0) -> dict:
        """The first `name` event logged after the last one this returned (the process logs as it goes)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            events = self.log_events()
            for index in range(self.log_seen, len(events)):
                if events[index].get("event") == name:
                    self.log_seen = index + 1
                    return events[index]
            if self.process.returncode is not None:
                raise AssertionError(f"serve exited {self.process.returncode} before logging {name}")
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"no {name} event within {timeout_s} s; log tail:\n{self.tail()}")
            await asyncio.sleep(0.05)

    def tail(self, chars: int = 3000) -> str:
        return self._log_text()[-chars:]

    async def healthz(self) -> tuple[int, dict]:
        def get() -> tuple[int, dict]:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2) as response:
                    return response.status, json.loads(response.read())
            except urllib.error.HTTPError as error:
                return error.code, json.loads(error.read() or b"{}")
        return await asyncio.to_thread(get)

    async def wait_healthy(self, timeout_s: float = 60.0, status: str | None = None) -> dict:
        """Until /healthz is 200 (and its body's status is `status`: "ok" once every engine worker is ready)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            if self.process.returncode is not None:
                raise AssertionError(f"serve exited {self.process.returncode}:\n{self.tail()}")
            try:
                code, body = await self.healthz()
                if code == 200 and status in (None, body.get("status")):
                    return body
            except OSError:
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"/healthz not 200 within {timeout_s} s:\n{self.tail()}")
            await asyncio.sleep(0.1)

    def signal(self, sig: signal.Signals) -> None:
        self.process.send_signal(sig)

    async def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; returns the exit status."""
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return await asyncio.wait_for(self.process.wait(), timeout_s)
        finally:
            if self.process.returncode is None:
                self.process.kill()
                await self.process.wait()


async def start_serve(workdir: Path, config: Path | None, *settings: str, engine: str | None = None,
                      log_name: str = "serve.log") -> ServeProcess:
    """Start `serve` (UDP SIP only) on free ports; `settings` are `--set KEY=VALUE` pairs. Returns at once."""
    sip_port, http_port = free_port(), free_port(socket.SOCK_STREAM)
    log_path = workdir / log_name
    command = [sys.executable, "-m", "gateway.cli", "serve", "--sip-listen", f"127.0.0.1:{sip_port}",
               "--http-listen", f"127.0.0.1:{http_port}", "--set", "sip.transports=[udp]"]
    if config is not None:
        command += ["--config", str(config)]
    if engine is not None:
        command += ["--engine", engine]
    for setting in settings:
        command += ["--set", setting]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    with log_path.open("wb") as log_file:
        process = await asyncio.create_subprocess_exec(*command, cwd=ROOT, stdout=log_file, stderr=log_file, env=env)
    return ServeProcess(process, sip_port, http_port, log_path)


@contextlib.asynccontextmanager
async def healthy_serve(workdir: Path, config_text: str, engine: str | None = None):
    """`serve` with `config_text` as its config file, once /healthz is 200; it must stop with exit 0."""
    config = workdir / "gateway.yaml"
    config.write_text(config_text)
    process = await start_serve(workdir, config, engine=engine)
    try:
        await process.wait_healthy()
        yield process
    finally:
        assert await process.stop() == 0
