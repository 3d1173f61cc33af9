"""WorkerSupervisor: starts the gateway's engine worker processes, restarts one that dies, stops them at exit.

One process per `WorkerPlan` (per GPU for cosyvoice2, `engine.workers` for CPU engines), each
`python -m engine_service ... --supervised`: the token goes in on stdin, which stays open for the gateway's
whole life, so a worker whose gateway was killed sees EOF and exits. A worker prints its URL once its engine
is ready; the supervisor hands it to the engine client (`on_listening`), which connects. A worker that exits
unasked is started again after a backoff (doubling to 30 s, reset after a minute of good running); its calls
already ended when its socket closed (engines.remote). The gateway's packet clock never shares a process
with synthesis threads this way.

Exit code 2 from a worker means its settings are wrong: restarting cannot fix that, so it is reported
(`failed`) and not retried, like the gateway's own config errors.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence

import structlog

from gateway import metrics
from gateway.engine_config import WorkerPlan

log = structlog.get_logger(__name__)

_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 30.0
_HEALTHY_RUN_S = 60.0  # a worker that ran this long before dying restarts at once


class WorkerFailed(RuntimeError):
    """A worker cannot be started (bad settings, or it died before it ever listened)."""


class WorkerSupervisor:
    def __init__(self, plans: Sequence[WorkerPlan], token: str, on_listening: Callable[[str, str], None],
                 stop_timeout_s: float = 10.0) -> None:
        self._plans = list(plans)
        self._token = token
        self._on_listening = on_listening
        self._stop_timeout_s = stop_timeout_s
        self._processes: dict[str, asyncio.subprocess.Process] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = False
        self._listened: dict[str, asyncio.Event] = {plan.name: asyncio.Event() for plan in self._plans}
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.restarts = 0

    @property
    def pids(self) -> dict[str, int]:
        return {name: process.pid for name, process in self._processes.items() if process.returncode is None}

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(plan), name=f"engine-worker-{plan.name}") for plan in self._plans]

    async def wait_listening(self) -> None:
        """Until every worker listened once; raises WorkerFailed if one cannot start."""
        listening = asyncio.ensure_future(asyncio.gather(*(event.wait() for event in self._listened.values())))
        await asyncio.wait({listening, self.failed}, return_when=asyncio.FIRST_COMPLETED)
        if self.failed.done():
            listening.cancel()
            self.failed.result()

    async def stop(self) -> None:
        """SIGTERM every worker (it closes its links and engine), SIGKILL what is left after the timeout."""
        self._stopping = True
        for process in self._processes.values():
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
        waits = [process.wait() for process in self._processes.values()]
        _, pending = await asyncio.wait([asyncio.ensure_future(w) for w in waits], timeout=self._stop_timeout_s) \
            if waits else (set(), set())
        for process in self._processes.values():
            if process.returncode is None:
                log.error("engine_worker_kill", pid=process.pid)
                process.kill()
        await asyncio.gather(*pending, return_exceptions=True)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("engine_workers_stopped", workers=len(self._processes))

    # -- one worker, for the gateway's whole life --------------------------------------------------
    async def _keep(self, plan: WorkerPlan) -> None:
        backoff = _BACKOFF_START_S
        while not self._stopping:
            started = time.monotonic()
            rc = await self._run_once(plan)
            if self._stopping:
                return
            listened = self._listened[plan.name].is_set()
            log.error("engine_worker_exited", worker=plan.name, rc=rc, ran_s=round(time.monotonic() - started, 2))
            if rc == 2 or not listened:
                why = "refused its settings (exit 2)" if rc == 2 else f"exited with {rc} before it was ready"
                if not self.failed.done():
                    self.failed.set_exception(WorkerFailed(f"engine worker {plan.name} {why}; see its log above"))
                return
            metrics.engine_worker_restarts_total.labels(worker=plan.name).inc()
            self.restarts += 1
            if time.monotonic() - started > _HEALTHY_RUN_S:
                backoff = _BACKOFF_START_S
            await asyncio.sleep(backoff)  # a restart backoff, so a crashing worker does not spin
            backoff = min(backoff * 2, _BACKOFF_MAX_S)

    async def _run_once(self, plan: WorkerPlan) -> int:
        process = await asyncio.create_subprocess_exec(*worker_command(plan), stdin=asyncio.subprocess.PIPE,
                                                       stdout=asyncio.subprocess.PIPE, env=_worker_env(plan))
        self._processes[plan.name] = process
        log.info("engine_worker_started", worker=plan.name, pid=process.pid, device=plan.device)
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(f"{self._token}\n".encode())  # stays open: EOF tells the worker we are gone
        while line := await process.stdout.readline():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "engine_worker_listening":
                log.info("engine_worker_listening", worker=plan.name, url=event["url"], pid=process.pid)
                self._on_listening(plan.name, event["url"])
                self._listened[plan.name].set()
        return await process.wait()


def worker_command(plan: WorkerPlan) -> list[str]:
    """The worker's command line; the same at every restart, so a fixed port (engine.worker.port) is taken again
    (asyncio's create_server sets SO_REUSEADDR on POSIX: the dead worker's connections in TIME_WAIT do not
    block the bind)."""
    command = [sys.executable, "-m", "engine_service", "--engine", plan.engine,
               "--settings", json.dumps(plan.settings, default=str),
               "--listen", f"{plan.listen_host}:{plan.listen_port}", "--token-file", "-", "--supervised",
               "--log-level", plan.log_level]
    if plan.tts_api is not None:
        command += ["--tts-api", json.dumps(plan.tts_api, default=str)]
    if plan.http_limits is not None:
        command += ["--http-limits", json.dumps(plan.http_limits)]
    if plan.prompt_texts:
        command += ["--prepare-texts", json.dumps(plan.prompt_texts, ensure_ascii=False)]
    if plan.device is not None:
        command += ["--device", plan.device]
    if plan.slots is not None:
        command += ["--slots", str(plan.slots)]
    return command


def _worker_env(plan: WorkerPlan) -> dict[str, str]:
    env = dict(os.environ)
    # One engine per process: a CPU worker keeps to a thread or two so N workers do not oversubscribe the
    # cores the gateway's packet clock needs.
    if plan.device is None:
        env.setdefault("OMP_NUM_THREADS", "1")
    return env
