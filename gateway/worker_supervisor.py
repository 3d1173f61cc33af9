"""WorkerSupervisor: starts the gateway's engine worker processes and keeps each one running for the gateway's life.

One process per `WorkerPlan` (per GPU for cosyvoice2, `engine.workers` for CPU engines), each
`python -m engine_service ... --supervised`: the token goes in on stdin, which stays open for the gateway's
whole life, so a worker whose gateway was killed sees EOF and exits. A worker prints its URL once its engine
is ready; the supervisor hands it to the engine client (`on_listening`), which connects. The gateway's packet
clock never shares a process with synthesis threads this way.

Never gives up. A worker that exits, for any reason (any code, any signal), is started again after a backoff
(0.5 s doubling to 30 s, back to 0.5 s once a run was ready for a minute), as long as the gateway runs. The one
exception is exit 2 before the worker was ever ready: its settings were refused, which no restart can fix, so
`refused` is set (the gateway's start fails with that one line, exit 2) and the worker stays down. After a
first ready, exit 2 is an exit like any other (Intel MKL exits 2 on its fatal errors, for one). The gateway
also kills (SIGKILL) a worker that is alive but useless: not listening within `start_timeout_s` of its start,
or listening but not serving its link (silent, disconnected, or its engine down) for `HUNG_KILL_S`; a SIGSTOPped
or wedged worker is restarted instead of left stuck. Its calls already ended when its link went silent.

Every start is the same as the first (a restart must not differ from the start that worked): the environment
and working directory are taken once, when the gateway starts; the directory is entered by name, so a
directory deleted and recreated under the gateway (a redeploy) is the new one, and a deleted one is replaced
by `/` (torch's MKL calls getcwd() at import and exits 2, "Intel oneMKL FATAL ERROR: Cannot load
.../libtorch_cpu.so", in a process whose working directory is gone). Each worker leads its own process
group (a new session), and when it exits the whole group is killed and waited for before the next start:
its children (torch inductor's compile workers live up to 60 s after their parent dies, holding memory and
the worker's stdout and stdin pipes) never outlive it. Only stdin, stdout and stderr are inherited.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import structlog

from gateway import metrics
from gateway.engine_config import WorkerPlan

log = structlog.get_logger(__name__)

_BACKOFF_START_S = 0.5
_BACKOFF_MAX_S = 30.0
_HEALTHY_RUN_S = 60.0  # a worker ready this long before it died restarts after the shortest backoff again
HUNG_KILL_S = 5.0  # listening but not serving its link this long: killed and restarted
_WATCH_S = 0.25  # how often a running worker's start deadline and link are checked
_GROUP_GONE_S = 10.0  # how long to wait for a dead worker's process group to be gone before starting anew
_LINE_MAX = 1 << 16  # a stdout line longer than this is not one of ours: dropped
# Handed to the gateway by systemd for itself alone: a worker must not notify or take its sockets.
_NOT_INHERITED = ("NOTIFY_SOCKET", "LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES", "WATCHDOG_PID", "WATCHDOG_USEC")


class WorkerFailed(RuntimeError):
    """A worker cannot be started with this config (its settings, or a GPU the gateway does not see)."""


@dataclass
class _Worker:
    """One supervised worker: what /healthz and the logs say of it."""

    plan: WorkerPlan
    env: dict[str, str]
    phase: str = "starting"  # starting | listening | restarting | refused | stopped
    pid: int | None = None
    started_at: float = 0.0  # monotonic
    listened_at: float | None = None  # this run's ready (URL printed)
    serving_at: float | None = None  # last time its link was seen serving
    ever_ready: bool = False
    last_exit: str = ""  # "exit code 1", "SIGKILL (hung)", ...
    last_ran_s: float = 0.0
    next_start_at: float = 0.0
    refusal: str = ""


class WorkerSupervisor:
    def __init__(self, plans: Sequence[WorkerPlan], token: str, on_listening: Callable[[str, str], None],
                 serving: Callable[[str], bool] = lambda _name: True, stop_timeout_s: float = 10.0) -> None:
        """`serving(name)`: whether the gateway's link to that worker is up and its engine ready (hang detection).
        Raises WorkerFailed when a plan cannot be run here (a GPU outside CUDA_VISIBLE_DEVICES)."""
        self._token = token
        self._on_listening = on_listening
        self._serving = serving
        self._stop_timeout_s = stop_timeout_s
        self._cwd = _working_directory()
        self._workers = {plan.name: _Worker(plan, worker_env(plan, os.environ)) for plan in plans}
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.refused = asyncio.Event()  # a worker's settings were refused before it was ever ready
        self.refusal = ""  # the first such refusal, in one line

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._keep(worker), name=f"engine-worker-{name}")
                       for name, worker in self._workers.items()]

    def supervises(self, name: str) -> bool:
        return name in self._workers

    def describe(self, name: str) -> dict:
        """What /healthz says of one worker's process: {state, pid, why} (why: for a worker not serving)."""
        worker, now = self._workers[name], time.monotonic()
        after = f", after {worker.last_exit} (ran {worker.last_ran_s:.1f} s)" if worker.last_exit else ""
        if worker.phase == "starting":
            why = f"starting for {now - worker.started_at:.1f} s{after}"
        elif worker.phase == "listening" and worker.serving_at is None:
            why = f"listening for {now - (worker.listened_at or now):.1f} s, its link not serving yet{after}"
        elif worker.phase == "listening":
            why = (f"listening, but its link has not served for {now - worker.serving_at:.1f} s "
                   f"(killed and restarted at {HUNG_KILL_S:g} s)")
        elif worker.phase == "restarting":
            why = (f"restarting after {worker.last_exit} (ran {worker.last_ran_s:.1f} s); "
                   f"next start in {max(worker.next_start_at - now, 0):.1f} s")
        elif worker.phase == "refused":
            why = f"settings refused, not restarted: {worker.refusal}"
        else:
            why = "stopped"
        return {"state": worker.phase, "pid": worker.pid if worker.phase in ("starting", "listening") else None,
                "why": why}

    async def stop(self) -> None:
        """SIGTERM every worker (it closes its links and engine), SIGKILL the groups of those left after the timeout."""
        self._stopping.set()
        running = [worker for worker in self._workers.values() if worker.phase in ("starting", "listening")]
        for worker in running:
            _signal_group_leader(worker.pid, signal.SIGTERM)
        _, pending = await asyncio.wait(self._tasks, timeout=self._stop_timeout_s) if self._tasks else (set(), set())
        if pending:
            for worker in self._workers.values():
                if worker.phase in ("starting", "listening") and worker.pid is not None:
                    log.error("engine_worker_kill", worker=worker.plan.name, pid=worker.pid)
                    _signal_group(worker.pid, signal.SIGKILL)
            _, pending = await asyncio.wait(pending, timeout=_GROUP_GONE_S)
        for task in pending:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        log.info("engine_workers_stopped", workers=len(self._workers))

    # -- one worker, for the gateway's whole life --------------------------------------------------
    async def _keep(self, worker: _Worker) -> None:
        name, backoff = worker.plan.name, _BACKOFF_START_S
        while not self._stopping.is_set():
            worker.started_at = time.monotonic()
            try:
                rc, killed_for = await self._run_once(worker)
            except Exception as exc:  # noqa: BLE001 - never give up on a worker: a start that failed is retried
                log.error("engine_worker_start_error", worker=name, error=repr(exc))
                rc, killed_for = None, None
            now = time.monotonic()
            worker.last_ran_s = now - worker.started_at
            worker.last_exit = _exit_text(rc) + (f" ({killed_for})" if killed_for else "")
            if self._stopping.is_set():
                worker.phase = "stopped"
                return
            if rc == 2 and not worker.ever_ready:
                worker.phase = "refused"
                worker.refusal = worker.refusal or "exit 2; see its log above"
                log.error("engine_worker_refused", worker=name, error=worker.refusal)
                if not self.refused.is_set():
                    self.refusal = f"engine worker {name} refused its settings: {worker.refusal}"
                    self.refused.set()
                return
            ready_s = None if worker.listened_at is None else round(now - worker.listened_at, 2)
            if ready_s is not None and ready_s >= _HEALTHY_RUN_S:
                backoff = _BACKOFF_START_S
            worker.phase, worker.next_start_at = "restarting", now + backoff
            log.error("engine_worker_exited", worker=name, pid=worker.pid, rc=rc if rc is None or rc >= 0 else None,
                      signal=signal.Signals(-rc).name if rc is not None and rc < 0 else None, killed_for=killed_for,
                      ran_s=round(worker.last_ran_s, 2), ready_s=ready_s, restart_in_s=backoff)
            metrics.engine_worker_restarts_total.labels(worker=name).inc()
            try:  # a restart backoff, so a crashing worker does not spin; cut short by stop()
                await asyncio.wait_for(self._stopping.wait(), backoff)
            except asyncio.TimeoutError:
                pass
            backoff = min(backoff * 2, _BACKOFF_MAX_S)
        worker.phase = "stopped"

    async def _run_once(self, worker: _Worker) -> tuple[int | None, str | None]:
        """Start the worker, watch it until it exits, then end its process group. Returns (returncode, why it was
        killed by us or None); the returncode is negative for a signal, as subprocess says."""
        plan, loop = worker.plan, asyncio.get_running_loop()
        cwd = self._cwd if os.path.isdir(self._cwd) else "/"
        if cwd != self._cwd:
            log.warning("engine_worker_cwd_gone", worker=plan.name, cwd=self._cwd, instead=cwd)
        pipes = _WorkerPipes(lambda event: self._on_event(worker, event))
        transport, _ = await loop.subprocess_exec(
            lambda: pipes, *worker_command(plan), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=None, env=worker.env, cwd=cwd, start_new_session=True, close_fds=True)
        pid = transport.get_pid()
        worker.pid, worker.phase, worker.started_at = pid, "starting", time.monotonic()
        worker.listened_at = worker.serving_at = None
        worker.refusal = ""
        log.info("engine_worker_started", worker=plan.name, pid=worker.pid, gpu=plan.gpu, device=plan.device, cwd=cwd)
        stdin = transport.get_pipe_transport(0)
        assert isinstance(stdin, asyncio.WriteTransport)
        stdin.write(f"{self._token}\n".encode())  # stays open: EOF tells the worker we are gone
        if self._stopping.is_set():  # stop() came while it was being started
            _signal_group_leader(pid, signal.SIGTERM)
        try:
            killed_for = await self._watch(worker, pipes)
        except BaseException:  # cancelled (stop), or a bug here: no worker is left running unwatched
            _signal_group(pid, signal.SIGKILL)
            transport.close()
            raise
        await _end_group(plan.name, pid)
        await asyncio.wait({pipes.stdout_closed}, timeout=1.0)  # its last lines (a refusal) are read
        transport.close()
        return pipes.exited.result(), killed_for

    async def _watch(self, worker: _Worker, pipes: _WorkerPipes) -> str | None:
        """Until the worker exits; kills it when it is overdue (see `_overdue`), returning why."""
        killed_for = None
        while not pipes.exited.done():
            await asyncio.wait({pipes.exited}, timeout=_WATCH_S)  # a period for the checks, not pacing
            if pipes.exited.done() or killed_for is not None or self._stopping.is_set():
                continue
            killed_for = self._overdue(worker)
            if killed_for is not None:
                log.error("engine_worker_killing", worker=worker.plan.name, pid=worker.pid, reason=killed_for,
                          state=self.describe(worker.plan.name)["why"])
                metrics.engine_worker_kills_total.labels(worker=worker.plan.name, reason=killed_for).inc()
                _signal_group(worker.pid, signal.SIGKILL)
        return killed_for

    def _overdue(self, worker: _Worker) -> str | None:
        """Why a live worker must be killed now ("start timeout", "hung"), or None."""
        now = time.monotonic()
        if worker.listened_at is None:
            return "start timeout" if now - worker.started_at > worker.plan.start_timeout_s else None
        if self._serving(worker.plan.name):
            worker.serving_at = now
            return None
        return "hung" if now - (worker.serving_at or worker.listened_at) > HUNG_KILL_S else None

    def _on_event(self, worker: _Worker, event: dict) -> None:
        name = worker.plan.name
        if event.get("event") == "engine_worker_listening" and isinstance(event.get("url"), str):
            worker.phase, worker.listened_at, worker.ever_ready = "listening", time.monotonic(), True
            log.info("engine_worker_listening", worker=name, url=event["url"], pid=worker.pid,
                     start_s=round(worker.listened_at - worker.started_at, 2))
            self._on_listening(name, event["url"])
        elif event.get("event") == "engine_worker_refused":
            worker.refusal = str(event.get("error", ""))


class _WorkerPipes(asyncio.SubprocessProtocol):
    """The worker's stdout lines, and its exit as soon as it happens. asyncio's Process.wait() returns only once
    every pipe is closed too, which a surviving child of the worker can put off for as long as it lives."""

    def __init__(self, on_event: Callable[[dict], None]) -> None:
        self._on_event = on_event
        self._transport: asyncio.SubprocessTransport | None = None
        self._buffer = b""
        loop = asyncio.get_running_loop()
        self.exited: asyncio.Future[int] = loop.create_future()
        self.stdout_closed: asyncio.Future[None] = loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.SubprocessTransport)
        self._transport = transport

    def pipe_data_received(self, fd: int, data: bytes) -> None:
        if fd != 1:
            return
        *lines, self._buffer = (self._buffer + data).split(b"\n")
        if len(self._buffer) > _LINE_MAX:
            self._buffer = b""
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._on_event(event)

    def pipe_connection_lost(self, fd: int, exc: Exception | None) -> None:
        if fd == 1 and not self.stdout_closed.done():
            self.stdout_closed.set_result(None)

    def process_exited(self) -> None:
        assert self._transport is not None
        returncode = self._transport.get_returncode()
        if not self.exited.done() and returncode is not None:
            self.exited.set_result(returncode)


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


def worker_env(plan: WorkerPlan, inherited: Mapping[str, str]) -> dict[str, str]:
    """The worker's environment: the gateway's (taken once, at its start), less what systemd meant for the gateway
    alone, plus the worker's GPU. Raises WorkerFailed for a GPU the gateway itself does not see."""
    env = {key: value for key, value in inherited.items() if key not in _NOT_INHERITED}
    if plan.gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = _visible_gpu(plan.gpu, inherited.get("CUDA_VISIBLE_DEVICES"))
    else:
        # One engine per process: a CPU worker keeps to a thread or two so N workers do not oversubscribe the
        # cores the gateway's packet clock needs.
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _visible_gpu(gpu: int, visible: str | None) -> str:
    """What CUDA_VISIBLE_DEVICES names GPU `gpu` as: the number itself, or the gateway's own list's entry (device
    numbers count the GPUs the gateway sees, as in CUDA: [0, 1] under CUDA_VISIBLE_DEVICES=2,3 are 2 and 3)."""
    if visible is None:
        return str(gpu)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if gpu >= len(entries):
        raise WorkerFailed(f"engine.cosyvoice2.devices: GPU {gpu} is not among the {len(entries)} the gateway sees "
                           f"(CUDA_VISIBLE_DEVICES={visible})")
    return entries[gpu]


def _working_directory() -> str:
    try:
        return os.getcwd()
    except FileNotFoundError:  # already deleted under us
        return "/"


def _exit_text(returncode: int | None) -> str:
    if returncode is None:
        return "a start that failed"
    return f"exit code {returncode}" if returncode >= 0 else signal.Signals(-returncode).name


def _signal_group(pgid: int | None, sig: int) -> bool:
    """Signal a worker's process group (the worker leads it); False once none of it is left."""
    if pgid is None:
        return False
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def _signal_group_leader(pid: int | None, sig: int) -> None:
    if pid is not None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


async def _end_group(name: str, pgid: int) -> None:
    """Kill what is left of a dead worker's process group (its children) and wait until none of it runs, so the
    next start does not share the GPU, memory or pipes with them; bounded: a process stuck in the kernel is logged."""
    left = await asyncio.to_thread(_group_members, pgid)
    _signal_group(pgid, signal.SIGKILL)
    if not left:
        return
    log.warning("engine_worker_children_killed", worker=name, pgid=pgid, pids=left)
    started = time.monotonic()
    while await asyncio.to_thread(_group_members, pgid):
        if time.monotonic() - started > _GROUP_GONE_S:
            log.error("engine_worker_group_lingers", worker=name, pgid=pgid, waited_s=_GROUP_GONE_S)
            return
        await asyncio.sleep(0.05)  # a restart waiting for the kernel, not media pacing
    log.info("engine_worker_group_gone", worker=name, pgid=pgid, waited_s=round(time.monotonic() - started, 2))


def _group_members(pgid: int) -> list[int]:
    """The processes of a group that still run. Zombies do not count: an orphan is reaped by whatever adopts it,
    and some container inits never do. Without /proc, the group as one pid while any of it is left."""
    if not os.path.isdir("/proc"):
        return [pgid] if _signal_group(pgid, 0) else []
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", encoding="ascii", errors="replace") as handle:
                state, _ppid, group = handle.read().rsplit(")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue  # gone meanwhile
        if group == str(pgid) and state not in ("Z", "X"):
            members.append(int(entry.name))
    return members
