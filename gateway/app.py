"""The running gateway: engine + media + SIP + HTTP wired together, with graceful drain.

`Gateway` owns the process-wide parts and one `CallSession` task per admitted INVITE (an `MrcpSession`,
gateway/mrcp/, when the INVITE's offer opens an MRCPv2 synthesizer channel). On SIGTERM it
stops admitting (SIP answers 503 + Retry-After, /healthz turns 503), lets prompts in progress finish
for at most `drain_timeout_s`, then ends what is left and exits. While the engine is down (the watchdog
restarts it) or has no free slot, INVITEs and OPTIONS get 503, so a PBX routes elsewhere instead of
reaching a call that would stay silent. SIGHUP reloads what can change under live calls (routes,
prompts, voice aliases, the trunk allow-list, logging; gateway/reload.py) and reopens the log file.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import signal
import sys
import time
from collections.abc import Callable
from types import MappingProxyType

import structlog

from connection_caps.budget import DescriptorBudget
from engines.base import EngineSettingsError, EngineUnavailable, NoCapacity, SpeechEngine, SynthesisRequest
from gateway import gc_pauses, metrics
from gateway.call import CallSession
from gateway.config import ConfigError, GatewayConfig
from gateway.engine_watchdog import EngineWatchdog, WatchdogSettings
from gateway.media.call_media import MediaEngine, MediaSettings
from gateway.mrcp.sdp import is_mrcp_offer
from gateway.mrcp.server import MrcpServer, MrcpSettings
from gateway.mrcp.session import MrcpSession
from gateway.routing import Prompt, PromptResolver
from gateway.sip.uas import InboundCall, SipServer, SipSettings
from gateway.speech import SpeechSettings

log = structlog.get_logger(__name__)

PACKET_CLOCK_SWITCH_INTERVAL_S = 0.001


class Gateway:
    def __init__(self, engine: SpeechEngine, sip_settings: SipSettings, media_settings: MediaSettings,
                 resolve_prompt: PromptResolver, watchdog_settings: WatchdogSettings | None = None,
                 mrcp_settings: MrcpSettings | None = None,
                 speech_settings: SpeechSettings | None = None) -> None:
        self.engine = engine
        self.watchdog = EngineWatchdog(engine, watchdog_settings or WatchdogSettings())
        self.media = MediaEngine(media_settings)
        self.speech = (speech_settings or SpeechSettings()).call_speech(engine)
        metrics.watch_prompt_cache(self.speech.cache)
        # With the prompt cache an INVITE is not refused at the edge for a full engine: a hit needs no engine
        # slot, and a miss is refused 503 by its call session (OPTIONS and /healthz still say full).
        cache_on = self.speech.cache_enabled
        self.sip = SipServer(sip_settings, on_invite=self._on_invite,
                             refusal=lambda: self.watchdog.refusal() or self.media.refusal(),
                             invite_refusal=lambda: self.watchdog.refusal(capacity=not cache_on) or self.media.refusal())
        self.resolve_prompt = resolve_prompt  # replaced once workers say which voice is their default
        # MRCPv2 (gateway/mrcp/): same SIP port, same admission; the control connections on their own listener
        self.mrcp = MrcpServer(mrcp_settings, lambda: self.sip.settings.allowed_sources) if mrcp_settings else None
        self._sessions: dict[asyncio.Task[str], CallSession | MrcpSession] = {}
        self.started_at: float | None = None

    async def start(self) -> None:
        t0 = time.monotonic()
        await self.engine.start()
        self.watchdog.start()
        await self.media.start()
        await self.sip.start()
        if self.mrcp is not None:
            await self.mrcp.start()
        self.started_at = time.monotonic()
        log.info("gateway_started", engine=self.engine.name, start_s=round(self.started_at - t0, 3),
                 sip_udp=_fmt(self.sip.udp_address), sip_tcp=_fmt(self.sip.tcp_address))

    def _on_invite(self, call: InboundCall) -> asyncio.Task[str] | None:
        """Start the call's session (an MRCP session when the offer opens one); the SIP server counts the call
        against max_calls until it is done."""
        session: CallSession | MrcpSession
        if is_mrcp_offer(call.remote_sdp):
            if self.mrcp is None:
                metrics.calls_refused_total.labels(reason="mrcp_offer").inc()
                call.reject(488, "Not Acceptable Here",
                            {"Warning": '399 cosyvoice-gateway "MRCPv2 is not enabled here (mrcp.enabled)"'})
                return None
            refusal = self.watchdog.refusal() if self.speech.cache_enabled else None
            if refusal is not None:  # the cache lets call INVITEs past a full engine; an MRCP session has no hits
                metrics.calls_refused_total.labels(reason=refusal.partition(":")[0]).inc()
                call.reject(503, "Service Unavailable", {"Retry-After": str(call.retry_after_s)})
                log.info("mrcp_session_refused", call_id=call.call_id, refusal=refusal)
                return None
            session = MrcpSession(call, self.speech, self.media, self.mrcp, dict(self.mrcp.settings.voice_aliases))
        else:
            session = CallSession(call, self.resolve_prompt, self.speech, self.media)
        task = asyncio.get_running_loop().create_task(session.run(), name=f"call-{call.call_id}")
        self._sessions[task] = session
        task.add_done_callback(lambda done: self._sessions.pop(done, None))
        return task

    async def prerender(self, prompts: list[Prompt]) -> None:
        """Measure the voices' levels and render `prompts` (those marked prerender) into the cache, one at a time
        (a background task at start that never holds more than one engine slot). An engine that is full or not
        ready (a worker's status frame still counting the slot just freed) is asked again, for up to a minute."""
        for voice in dict.fromkeys(prompt.voice for prompt in prompts):
            try:
                await _when_admitted(lambda voice=voice: self.speech.gain_db(voice))
            except Exception as exc:  # the next call of that voice measures it again
                log.warning("voice_level_not_measured", voice=voice, error=repr(exc))
        for prompt in prompts:
            request = SynthesisRequest(text=prompt.text, voice=prompt.voice, call_id="prerender",
                                       options=MappingProxyType(dict(prompt.options)), paced=False)
            try:
                self.engine.validate(request)
                hit = await _when_admitted(lambda request=request: self.speech.prerender(request))
            except Exception as exc:
                log.warning("prerender_failed", voice=prompt.voice, chars=len(prompt.text), error=repr(exc))
            else:
                log.info("prerendered", voice=prompt.voice, chars=len(prompt.text), already_cached=hit)

    async def calls_ended(self, timeout_s: float) -> bool:
        """Wait until every call session now running has finished and counted its outcome (True), or timeout."""
        if self._sessions:
            _, pending = await asyncio.wait(set(self._sessions), timeout=timeout_s)
            return not pending
        return True

    def reconfigure(self, resolve_prompt: PromptResolver, allowed_sources) -> None:
        """Adopt reloaded routes/prompts and trunk allow-list; calls already admitted keep their prompt."""
        self.resolve_prompt = resolve_prompt
        self.sip.settings = dataclasses.replace(self.sip.settings, allowed_sources=allowed_sources)

    @property
    def draining(self) -> bool:
        return self.sip.draining

    def status(self) -> dict:
        """/healthz's body. Healthy (200) exactly when a new INVITE would be taken now: the SIP layer's
        `why_refused` decides both, so /healthz and a qualify OPTIONS never disagree (issue #31)."""
        health = self.watchdog.check_now()
        refusal = self.sip.why_refused()
        kind = refusal.partition(":")[0] if refusal is not None else ""
        state = {"": "ok", "engine_unavailable": f"engine_{health.state}", "no_capacity": "full"}.get(kind, kind)
        return {"status": state, "refusal": refusal, "engine": self.engine.name, "engine_state": health.state,
                "engine_reason": health.reason, "slots_total": health.slots_total, "slots_free": health.slots_free,
                "calls_active": len(self._sessions), "draining": self.draining,
                "engine_restarts": self.watchdog.restarts,
                "rtp_port_pairs_free": self.media.port_pairs_free, "rtp_port_pairs_total": self.media.port_pairs_total,
                "healthy": refusal is None}

    async def drain(self, timeout_s: float, bye_grace_s: float = 2.0) -> None:
        """Stop admitting calls; let the current ones finish for up to timeout_s, then hang up the rest
        with a proper BYE (a caller should hear the line close, not silence) and give those BYEs
        `bye_grace_s` to complete before the sessions are cancelled."""
        self.sip.draining = True
        log.info("draining", calls=len(self._sessions), timeout_s=timeout_s)
        if not self._sessions:
            return
        _, pending = await asyncio.wait(set(self._sessions), timeout=timeout_s)
        if not pending:
            return
        log.info("drain_timeout_hanging_up", calls=len(pending))
        for task in pending:
            session = self._sessions.get(task)
            if session is not None:
                session.call.hangup()
        _, pending = await asyncio.wait(pending, timeout=bye_grace_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def stop(self) -> None:
        tasks = list(self._sessions)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.sip.stop()
        if self.mrcp is not None:
            await self.mrcp.stop()
        await self.media.stop()
        await self.speech.close()
        await self.watchdog.stop()
        await self.engine.close()
        log.info("gateway_stopped")


async def _when_admitted(attempt, give_up_after_s: float = 60.0):
    """`await attempt()`, again after a pause while the engine refuses for room or readiness (503 kinds)."""
    deadline = time.monotonic() + give_up_after_s
    pause = 0.2
    while True:
        try:
            return await attempt()
        except (NoCapacity, EngineUnavailable):
            if time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)  # a retry schedule for background work, not media pacing
            pause = min(pause * 2, 5.0)


def _fmt(address: tuple[str, int] | None) -> str | None:
    return f"{address[0]}:{address[1]}" if address else None


def _engine_for(config):
    """The engine the config asks for: in this process, or a client of supervised and/or remote workers
    (with the supervisor that runs the local ones, or None)."""
    from engines.registry import create_engine

    engine_config = config.engine
    if not engine_config.uses_workers:
        return create_engine(engine_config.name, config.engine_settings()), None
    import secrets

    from engines.remote import RemoteEngine
    from gateway.worker_supervisor import WorkerFailed, WorkerSupervisor

    engine = RemoteEngine(urls=engine_config.remote.urls, token=engine_config.remote.token,
                          engine_name=engine_config.name, default_voice=engine_config.default_voice,
                          identity=_workers_identity(config),
                          max_first_audio_ms=engine_config.admission.max_first_audio_ms,
                          dead_after_s=engine_config.worker.dead_after_ms / 1000,
                          on_streams_lost=lambda worker, count:
                          metrics.engine_worker_streams_lost_total.labels(worker=worker).inc(count))
    plans = config.worker_plans()
    if not plans:
        return engine, None
    # this gateway's own workers: a fresh secret per start, unless other gateways of the host share them
    token = engine_config.worker.token or secrets.token_urlsafe(32)
    links = {plan.name: engine.add_worker(plan.name, None, token=token) for plan in plans}
    try:
        supervisor = WorkerSupervisor(plans, token, on_listening=engine.worker_at,
                                      serving=lambda name: links[name].usable)
    except WorkerFailed as exc:
        raise ConfigError([str(exc)]) from None
    return engine, supervisor


def _workers_identity(config) -> str:
    """The workers' model identity for the prompt cache: their engine settings and the files of their model and
    voices directories (speech_audio/model_identity.py); workers on another host whose paths are not here count
    by their settings only."""
    import hashlib
    import json
    from pathlib import Path

    from speech_audio.model_identity import files_identity

    settings = config.engine_settings()
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:12]
    directories = [Path(str(settings[key])) for key in ("model_dir", "voices_dir") if settings.get(key)]
    return files_identity(f"{config.engine.name}:{digest}", *directories)


async def _engine_ready(engine, supervisor, config, stop: asyncio.Event) -> bool:
    """Until one worker is ready (False if asked to stop first); SIP answers 503 and /healthz says warming
    meanwhile. No deadline: workers that fail are started again for as long as it takes (a GPU still held by
    another process, a remote host not up yet), each start bounded by engine.worker.start_timeout_s. Only a
    worker's settings refused (exit 2 before its first ready) fails the start: a config error, exit 2."""
    waits = {asyncio.ensure_future(engine.wait_ready()), asyncio.ensure_future(stop.wait())}
    if supervisor is not None:
        waits.add(asyncio.ensure_future(supervisor.refused.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in waits:
            task.cancel()
        await asyncio.gather(*waits, return_exceptions=True)  # retrieved: no "never retrieved"
    if supervisor is not None and supervisor.refused.is_set():
        raise ConfigError([f"engine.{config.engine.name}: {supervisor.refusal}"])
    return not stop.is_set()


async def run(config, load_again: Callable[[], GatewayConfig] | None = None) -> None:
    """Serve until SIGTERM/SIGINT, then drain. `config` is a validated `gateway.config.GatewayConfig`;
    `load_again` reads and validates the config file anew (SIGHUP), with the command line's overrides."""
    from gateway.http_api import start_http, stop_http
    from gateway.worker_report import with_workers

    # Engine threads (synthesis, the GPU scheduler) run Python too; when one holds the GIL, the event
    # loop waits up to the switch interval before it can run a due packet-clock tick. CPython's 5 ms
    # default showed up directly as send jitter (25 % of ticks > 2 ms late at 250 calls); 1 ms bounds it.
    # With engine workers (engine.workers, cosyvoice2 devices) no synthesis thread runs here at all.
    sys.setswitchinterval(PACKET_CLOCK_SWITCH_INTERVAL_S)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    hangups = asyncio.Event()
    # Installed before the engine starts (minutes for a GPU model): SIGHUP's default action kills the
    # process, and a logrotate during start-up must not. A reload asked for then waits until we serve.
    loop.add_signal_handler(signal.SIGHUP, hangups.set)
    engine, supervisor = _engine_for(config)
    # One descriptor budget for the connection listeners (SIP TCP, HTTP), keeping RTP's sockets free.
    budget = DescriptorBudget.from_rlimit(reserved=config.rtp_descriptors())
    http_limits = config.http.http_limits()
    gateway = Gateway(
        engine=engine,
        sip_settings=config.sip_settings(budget),
        media_settings=config.media_settings(),
        resolve_prompt=config.prompt_resolver(engine.default_voice),
        mrcp_settings=config.mrcp_settings(),
        speech_settings=config.speech_settings(),
    )
    try:
        await gateway.start()
    except EngineSettingsError as exc:  # in-process: what only the engine could check, one line and exit 2
        raise ConfigError([str(exc)]) from None
    # /healthz with workers: how many serve, and why each other one does not (gateway/worker_report.py)
    status = with_workers(gateway.status, engine.links, supervisor) if config.engine.uses_workers else gateway.status
    http = None
    reloader: asyncio.Task[None] | None = None
    prerender: asyncio.Task[None] | None = None
    try:
        if supervisor is not None:
            await supervisor.start()
        if config.engine.uses_workers:
            # SIP answers 503 and /healthz says warming until a worker is ready
            http = await start_http(status, config.http_host, config.http_port, http_limits, budget)
            if await _engine_ready(engine, supervisor, config, stop):
                gateway.resolve_prompt = config.prompt_resolver(engine.default_voice)
        # Everything loaded at start (engine, model, config) is long-lived: move it out of the cyclic GC's
        # view so a full collection mid-call has less to walk (a pause there is a late packet for every call).
        gc.collect()
        gc.freeze()
        gc_pauses.watch()
        # engines that discover their voices at start (cosyvoice2, workers): refuse routes naming a missing one
        if not stop.is_set():
            config.check_voices(engine.voices())
            if not config.engine.uses_workers:  # workers prepared theirs before they listened
                await engine.prepare(config.prompt_texts())
        if http is None:
            http = await start_http(status, config.http_host, config.http_port, http_limits, budget)
        prerendered = config.prompt_resolver(engine.default_voice).prerendered()
        if prerendered and not stop.is_set():  # other voices are measured on their first call, in the background
            prerender = loop.create_task(gateway.prerender(prerendered), name="prerender")
        reloader = loop.create_task(_reload_on_hangup(hangups, gateway, config, load_again), name="sighup")
        await stop.wait()
        await gateway.drain(config.shutdown.drain_timeout_s)
    finally:
        for task in (reloader, prerender):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if http is not None:
            await stop_http(http)
        await gateway.stop()
        if supervisor is not None:
            await supervisor.stop()


async def _reload_on_hangup(hangups: asyncio.Event, gateway: Gateway, config: GatewayConfig,
                            load_again: Callable[[], GatewayConfig] | None) -> None:
    """Each SIGHUP: re-read the file, adopt what can change live, reopen the log file. A file that does not
    validate is refused with one logged error and the running config stays (gateway/reload.py)."""
    from gateway.log import reopen_logs
    from gateway.reload import plan_reload

    while True:
        await hangups.wait()
        hangups.clear()
        try:
            new = await asyncio.to_thread(load_again) if load_again is not None else config
            plan = plan_reload(config, new, gateway.engine.voices())
        except ConfigError as exc:
            plan, refused = None, exc
        else:
            config = plan.config
            gateway.reconfigure(config.prompt_resolver(gateway.engine.default_voice), config.allowed_sources)
            # in-process engines prepare the new prompts now; workers learn them at their next start
            await gateway.engine.prepare(config.prompt_texts())
        # reopen first, so the outcome below lands in the new file that the operator is watching
        try:
            reopen_logs(config.logging.level, config.logging.file)
        except OSError as exc:
            log.error("log_reopen_failed", file=config.logging.file, error=str(exc))
        else:
            log.info("logs_reopened", file=config.logging.file)
        if plan is None:
            log.error("config_reload_refused", errors=refused.errors)
            continue
        if plan.needs_restart:
            log.warning("config_reload_needs_restart", sections=list(plan.needs_restart))
        log.info("config_reloaded", changed=list(plan.changed))
