"""EngineWatchdog: notices a speech engine that died or hangs, refuses calls meanwhile, and restarts it.

The gateway cannot trust an engine to say it broke: a worker thread that died on one bad request, or hangs in
C, says nothing. So the watchdog asks `engine.health()` every `interval_s` on the event loop (a cheap,
non-blocking read), keeps the answer, says from it why a new call is refused (`refusal`: the engine's part of
the one decision that SIP admission, out-of-dialog OPTIONS and /healthz all take), and on `down` restarts the
engine with a deadline, so a restart that itself hangs leaves the engine down (calls refused with 503) and is
tried again, never a loop that answers calls into silence.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import structlog

from engines.base import EngineHealth, SpeechEngine
from engines.remote import FIRST_AUDIO_REASON
from gateway import metrics

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class WatchdogSettings:
    interval_s: float = 0.5
    restart_timeout_s: float = 60.0
    restart_backoff_s: float = 2.0  # between failed restarts, so a broken install does not spin


class EngineWatchdog:
    def __init__(self, engine: SpeechEngine, settings: WatchdogSettings) -> None:
        self._engine = engine
        self._settings = settings
        self._task: asyncio.Task[None] | None = None
        self.health: EngineHealth = engine.health()
        self.restarts = 0
        self.restarted = asyncio.Event()  # set after each successful restart (tests and operators wait on it)

    def start(self) -> None:
        self._observe()
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="engine-watchdog")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def check_now(self) -> EngineHealth:
        """Fresh health at admission time, so a call never waits up to one interval to learn of a death."""
        return self._observe()

    def refusal(self, capacity: bool = True) -> str | None:
        """The engine's part of why a new call (or a qualify ping, or /healthz) is turned away now, or None:
        asked before an INVITE is parsed further, so a dead or full engine costs the PBX one 503, never an
        answered silent call. "kind: detail"; the kind is the bounded reason label of gateway_calls_refused_total."""
        health = self.check_now()
        if health.state != "ready":
            return f"engine_unavailable: engine {health.state} {health.reason}".rstrip()
        if capacity and not health.accepting:  # capacity=False: only down/warming refuses
            kind = "first_audio_bound" if health.reason.startswith(FIRST_AUDIO_REASON) else "no_capacity"
            return f"{kind}: {health.reason or 'engine at capacity'}"
        return None

    def _observe(self) -> EngineHealth:
        health = self._engine.health()
        if health.state != self.health.state:
            log.info("engine_health_changed", engine=self._engine.name, state=health.state, reason=health.reason)
        self.health = health
        metrics.engine_up.set(1 if health.state == "ready" else 0)
        return health

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._settings.interval_s)  # a period, not pacing media
            if self._observe().state == "down":
                await self._restart()

    async def _restart(self) -> None:
        reason = self.health.reason
        log.error("engine_down_restarting", engine=self._engine.name, reason=reason)
        metrics.engine_restarts_total.inc()
        self.restarts += 1
        try:
            await asyncio.wait_for(self._engine.restart(), self._settings.restart_timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure: stays down: calls keep getting 503, and we try again after the backoff
            log.error("engine_restart_failed", engine=self._engine.name, error=repr(exc))
            await asyncio.sleep(self._settings.restart_backoff_s)
            return
        health = self._observe()
        log.info("engine_restarted", engine=self._engine.name, state=health.state)
        self.restarted.set()
        self.restarted = asyncio.Event()
