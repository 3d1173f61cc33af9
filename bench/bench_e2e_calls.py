"""End-to-end calls as a caller hears them: N concurrent raw-SIP calls into a running `cosyvoice-gateway serve`.

bench_calls.py measures the gateway's sending side (tcpdump on its RTP). This one is an independent caller:
each call has its own SIP socket and RTP socket (plain UDP, no SIPp) in one of `--caller-processes` spawned
callers (e2e_caller.py), places its INVITE at ~`--rate` new calls per second, ACKs the 200, answers the
gateway's BYE, and times at the receiver with the kernel's receive timestamps (SO_TIMESTAMPNS), so a busy
caller does not count its own lateness against the gateway: first packet (INVITE sent -> first RTP packet) and
first speech (-> first payload that is not all G.711 zero codes: an engine whose audio starts quietly shows as a
later first speech than first packet), RTP arrival intervals, gaps over 60 ms, packets lost (RTP sequence
gaps), 503 answers (with the reason the gateway gave), and beside first speech the engine's own first chunk
(its workers' tts_job_done log lines; cosyvoice2 only). The gateway is started by the bench itself from a config
(`--config`, or bench_calls' loopback config with `--engine` and `--workers`), with its CPU time read from
/proc for the serve process and its engine workers separately, and from its /metrics its packet clock's own
lateness and skipped ticks and its full GC pauses (`clock_figures`): a stall the callers hear, named.

Several gateway processes (`--also-sip`: round robin from the callers; or `--sip` a proxy in front, Kamailio):
each answered call is put down to the gateway its 200's Contact names (`by_gateway`), with that process's CPU
and /metrics figures for those given in `--watch`. Cached steps' callers can hang up `--hear-s` after their
first speech, so calls last as long whatever length each engine made the prompt.

    python bench/bench_e2e_calls.py --engine instant --calls 1 50 100
    python bench/bench_e2e_calls.py --engine instant --first-chunk-delay-ms 70 --workers 1 --calls 1 1 1 1 1
    python bench/bench_e2e_calls.py --config gpu.yaml --calls 50 100 200 --rate 10   # a GPU host
    python bench/bench_e2e_calls.py --config gpu.yaml --devices 0 1 --calls 200 --kill-worker-at 10   # 2 GPUs

`--devices` runs one supervised cosyvoice2 worker per listed GPU. `--kill-worker-at S` kill -9s one worker
(`--kill-worker`, default index 1: the second GPU's) S seconds into every step, and the step's row then says
which worker served each call (the pid in the engine's tts_job_queued/_done lines, named by the supervisor's
engine_worker_started), the killed worker's calls apart from the others' (early BYEs, gaps over 60 ms, RTP
p99/max), and how long until /healthz (and the gateway's log) had that worker back.

How long a call lasts: its route's text is sized to `--prompt-seconds` as the engine speaks it (`--prompt-length
spoken`, bench/spoken_prompt.py). The instant engine speaks 60 ms a character. The full-size random CosyVoice
model never stops on its own, so a text segment runs to 20 x its text tokens: a 30-s prompt is a one-segment text
of 59 characters (39 tokens with the bench model's tokenizer) that every call speaks for 31.2 s (780 tokens), and
the served config's `max_len` is raised to 1024 to hold its prefill and tokens (the start-up line `prompts` says
what was sized and raised). So at `--rate 10` about 300 calls play at once. `--prompt-length chars` is the old
sizing (60 ms a character for every engine): 500 characters, a 481-position prefill in max_len 768, and the KV room
ended each 30-s cosyvoice2 call at 11.5 s (~115 playing at 10 calls/s).

Results: bench/results/e2e_calls.json (one row per step).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calls import (cpu_seconds, free_port, gateway_config, histogram_of, late_share,  # noqa: E402
                         metric, metric_of, scrape, wait_http)
from e2e_caller import PlannedCall, place_schedule  # noqa: E402
from engine_log import job_events, serve_events  # noqa: E402
from spoken_prompt import PROMPT_LENGTHS, BenchPrompts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GAP_MS = 60.0
CALLS_PER_CALLER = 100  # 5,000 packets/s each: headroom; one caller lost none at 500 calls on 2 cores (p99 21.2 ms)


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def engine_jobs(log_path: Path, offset: int) -> list[dict]:
    """The tts_job_done lines our calls' jobs logged past `offset` of serve's log (first chunk and its stages)."""
    events, _ = job_events(log_path, offset)
    return [event for event in events
            if event["event"] == "tts_job_done" and str(event.get("call_id", "")).startswith("e2e-")]


def worker_names(config: dict) -> list[str]:
    """The supervised workers' names in index order, as the gateway names them (engine_config.worker_plans)."""
    engine = config.get("engine", {})
    name = engine.get("name", "espeak")
    devices = (engine.get("cosyvoice2") or {}).get("devices") if name == "cosyvoice2" else None
    if devices:
        return [f"{name}-cuda:{device}" for device in devices]
    count = engine.get("workers")
    if count is None:
        count = 1 if name == "cosyvoice2" else 0
    return [f"{name}-{index}" for index in range(count)]


def _event_time(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _health(http_port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=2) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 503 while no worker is ready: the body says why
        return json.loads(exc.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return {}


def _capacity(health: dict) -> tuple:
    """What /healthz says of the workers' readiness: their count where it reports one, and the slots of the
    ready workers (a killed worker's slots leave the total until it is back)."""
    return health.get("workers_ready"), health.get("slots_total")


async def kill_worker(at_s: float, started: float, name: str, log_path: Path, http_port: int,
                      watch_s: float) -> dict:
    """At `started` + `at_s` (time.time()), kill -9 the worker `name` (its pid from serve's latest
    engine_worker_started line for it), then poll /healthz every 0.1 s until it reports the worker back
    (`_capacity` drops, then returns to what it was); also when the gateway logged it connected again."""
    await asyncio.sleep(max(0.0, started + at_s - time.time()))
    before = await asyncio.to_thread(_health, http_port)
    pids = [e["pid"] for e in serve_events(log_path, ("engine_worker_started",)) if e.get("worker") == name]
    if not pids:
        return {"worker": name, "error": "no engine_worker_started line for it"}
    offset = log_path.stat().st_size
    os.kill(pids[-1], signal.SIGKILL)
    killed = time.time()
    dropped_at = back_at = None
    while time.time() - killed < watch_s:
        now = _capacity(await asyncio.to_thread(_health, http_port))
        if dropped_at is None and now != _capacity(before):
            dropped_at = time.time()
        elif dropped_at is not None and now == _capacity(before):
            back_at = time.time()
            break
        await asyncio.sleep(0.1)
    connected = [e for e in serve_events(log_path, ("engine_worker_connected",), offset) if e.get("worker") == name]
    return {"worker": name, "pid": pids[-1], "at_s": at_s,
            "healthz_noticed_s": None if dropped_at is None else round(dropped_at - killed, 2),
            "healthz_ready_again_s": None if back_at is None else round(back_at - killed, 2),
            "connected_again_s": round(_event_time(connected[0]) - killed, 2) if connected else None}


def _rtp_figures(calls: list, longest_s: float) -> dict:
    """Early BYEs (the gateway hung up before the call heard 90 % of the longest call's audio), gaps over
    GAP_MS and RTP arrival interval p99/max of these answered calls."""
    gaps = [np.diff(np.frombuffer(c.arrivals_ns, dtype=np.int64)) / 1e6 for c in calls if len(c.arrivals_ns) > 1]
    intervals = np.concatenate(gaps or [np.zeros(0)])
    return {"calls": len(calls),
            "early_bye": sum(1 for c in calls if c.bye_ns is not None and len(c.arrivals_ns) * 0.02 < 0.9 * longest_s),
            "calls_with_gap_over_60ms": sum(1 for g in gaps if g.max() > GAP_MS),
            "rtp_interval_p99_ms": _pct(intervals, 99), "rtp_interval_max_ms": _pct(intervals, 100)}


def by_worker(answered: list, jobs: list[dict], pids: dict[int, str], killed: str | None) -> dict:
    """Which worker served each answered call (its job lines' pid, named by engine_worker_started), and
    the RTP figures of the killed worker's calls, the others' and those no job line names."""
    served = {job["call_id"]: pids.get(job.get("pid"), f"pid {job.get('pid')}") for job in jobs if "call_id" in job}
    longest = max((len(c.arrivals_ns) * 0.02 for c in answered), default=0.0)
    groups: dict[str, list] = {"killed_worker": [], "other_workers": [], "unattributed": []}
    for c in answered:
        worker = served.get(c.call_id)
        groups["unattributed" if worker is None else "killed_worker" if worker == killed else "other_workers"].append(c)
    return {"per_call": [{"call_id": c.call_id, "worker": served.get(c.call_id), "packets": len(c.arrivals_ns),
                          "bye": c.bye_ns is not None} for c in answered],
            **{group: _rtp_figures(calls, longest) for group, calls in groups.items()}}


def first_chunk_stages(jobs: list[dict], prefix: str = "first_chunk_") -> dict[str, dict[str, float]]:
    """Mean and p95 (ms) of each first-chunk stage the jobs logged (tts_core's JobTimings.first_chunk_stages);
    with prefix "first_render_", of the parts of its render stage (flow, hift, handoff: SynthesisJob.figures);
    with "second_chunk_", of the second chunk's figures (after the first, margin, decode, render)."""
    names = [key for key in (jobs[0] if jobs else {}) if key.startswith(prefix) and key.endswith("_ms")]
    return {name.removeprefix(prefix).removesuffix("_ms"): {
        "mean": round(float(np.mean([job[name] for job in jobs])), 1), "p95": _pct([job[name] for job in jobs], 95)}
        for name in names if all(name in job for job in jobs)}


def _pct(values, q):
    return round(float(np.percentile(values, q)), 1) if len(values) else None


def call_figures(results: list, jobs: list[dict]) -> dict:
    """What the callers of `results` heard (answered, refused, first speech and packet, RTP intervals, gaps,
    losses) beside the engine's first chunk of `jobs` (their tts_job_done lines)."""
    engine_first = [1000 * job["first_chunk_s"] for job in jobs]
    answered = [c for c in results if c.status == 200]
    first = [(c.first_speech_ns - c.invite_ns) / 1e6 for c in answered if c.first_speech_ns is not None]
    first_packet = [(c.arrivals_ns[0] - c.invite_ns) / 1e6 for c in answered if c.arrivals_ns]
    gaps_ms = [np.diff(np.frombuffer(c.arrivals_ns, dtype=np.int64)) / 1e6 for c in answered if len(c.arrivals_ns) > 1]
    intervals = np.concatenate(gaps_ms or [np.zeros(0)])
    refusals: dict[str, int] = {}
    for c in results:
        if c.status != 200:
            key = f"{c.status} {c.reason}"
            refusals[key] = refusals.get(key, 0) + 1
    return {"answered": len(answered), "refused_503": sum(1 for c in results if c.status == 503),
            "other_outcomes": refusals,
            "first_speech_p50_ms": _pct(first, 50), "first_speech_p95_ms": _pct(first, 95),
            "first_speech_max_ms": _pct(first, 100),
            "first_packet_p50_ms": _pct(first_packet, 50), "first_packet_p95_ms": _pct(first_packet, 95),
            "engine_first_chunk_p50_ms": _pct(engine_first, 50), "engine_first_chunk_p95_ms": _pct(engine_first, 95),
            "engine_first_chunk_stages_ms": first_chunk_stages(jobs),
            "engine_first_render_split_ms": first_chunk_stages(jobs, "first_render_"),
            "rtp_interval_p50_ms": _pct(intervals, 50), "rtp_interval_p99_ms": _pct(intervals, 99),
            "rtp_interval_max_ms": _pct(intervals, 100),
            "calls_with_gap_over_60ms": sum(1 for g in gaps_ms if g.max() > GAP_MS),
            "heard_s_p50": _pct([len(c.arrivals_ns) * 0.02 for c in answered], 50),
            "lost_packets": sum(c.lost for c in answered)}


def mixed_schedule(cached: int, uncached: int, ramp_s: float, cached_user: str, user: str,
                   also: list[tuple[str, int]] = (), hear_s: float | None = None) -> list[PlannedCall]:
    """`cached` calls to `cached_user` (a route whose prompt the cache holds) and `uncached` calls to `user`,
    each kind spread evenly over `ramp_s` seconds and interleaved (issue #32: cached calls beside uncached ones).
    With `also` (other gateway processes of the host, sharing the step's engine workers through engine.remote),
    each kind's calls go round-robin to the step's gateway (None) and those. With `hear_s`, every caller hangs up that
    long after its first speech: calls last as long on every gateway, whatever length its engine made the prompt
    (and a caller that sends no RTP is not ended by the gateway's media.inactivity_timeout_s first)."""
    targets = [None, *also]  # each kind round-robin on its own, so both kinds spread evenly
    planned = [(i * ramp_s / cached, cached_user, targets[i % len(targets)]) for i in range(cached)]
    planned += [((j + 0.5) * ramp_s / uncached, user, targets[j % len(targets)]) for j in range(uncached)]
    return [PlannedCall(index, at_s, who, hang_up_after_s=hear_s, sip=sip)
            for index, (at_s, who, sip) in enumerate(sorted(planned, key=lambda p: p[0]))]


def clock_figures(before: str, after: str) -> dict:
    """The gateway's own view of a step from two /metrics scrapes: its packet clock's slot ticks later than
    2 / 10 / 20 ms (share), skipped ticks, and its cyclic GC's full collections (count, and how many held the
    loop over 10 / 50 ms)."""
    late0, late1 = (histogram_of(text, "gateway_packet_clock_lateness_seconds") for text in (before, after))
    gc0, gc1 = (histogram_of(text, "gateway_gc_pause_seconds", 'generation="2"') for text in (before, after))
    full = gc1.get(float("inf"), 0.0) - gc0.get(float("inf"), 0.0)
    return {"clock_ticks": int(late1.get(float("inf"), 0.0) - late0.get(float("inf"), 0.0)),
            **{f"clock_late_over_{ms}ms_pct": round(100 * late_share(late0, late1, ms / 1000), 3) if late1 else None
               for ms in (2, 10, 20)},
            "clock_skipped_ticks": int(metric_of(after, "gateway_packet_clock_skipped_ticks_total")
                                       - metric_of(before, "gateway_packet_clock_skipped_ticks_total")),
            "gc_full_collections": int(full),
            **{f"gc_full_over_{ms}ms": int(full - (gc1.get(ms / 1000, 0.0) - gc0.get(ms / 1000, 0.0)))
               for ms in (10, 50)}}


CACHE_METRICS = ("gateway_prompt_cache_hits_total", "gateway_prompt_cache_misses_total")


@dataclass(frozen=True)
class Watched:
    """A gateway process whose CPU time and /metrics a step reads (`--watch SIPHOST:PORT,HTTP_PORT,PID`)."""

    sip: str
    http_port: int
    pid: int

    @classmethod
    def parse(cls, text: str) -> Watched:
        sip, http_port, pid = text.split(",")
        return cls(sip, int(http_port), int(pid))

    def read(self) -> tuple[float, str]:
        return cpu_seconds(self.pid), scrape(self.http_port)


def gateway_row(calls: list, wall: float, before: tuple[float, str] | None, after: tuple[float, str] | None) -> dict:
    """One gateway process over a step: what its callers heard and, when watched (`before`/`after` its CPU time
    and /metrics), its CPU (seconds, share of one core, ms per answered call) and its clock and GC figures."""
    if before is None or after is None:
        return {"calls": len(calls), **call_figures(calls, [])}
    answered = sum(1 for c in calls if c.status == 200)
    cpu = after[0] - before[0]
    return {"calls": len(calls), **call_figures(calls, []), "cpu_s": round(cpu, 2),
            "cpu_core_share": round(cpu / wall, 3) if wall else None,
            "cpu_ms_per_call": round(1000 * cpu / max(answered, 1), 1), **clock_figures(before[1], after[1])}


async def run_step(schedule: list[PlannedCall], processes: int, rate: float, sip: tuple[str, int], gateway_pid: int,
                   timeout_s: float, http_port: int, log_path: Path, kill: tuple[float, str] | None = None,
                   watch: list[Watched] = ()) -> dict:
    """One step of the `schedule`d calls; with `kill` (seconds after the step began, worker name), that worker is
    killed with SIGKILL meanwhile and the row says how its calls and the others' fared (`by_worker`). A schedule
    calling several users has a row per user too (`by_user`), with the engine jobs of that user's calls (zero
    for a cached prompt); a step with cached calls has the prompt cache's hit and miss counts over the step.
    Calls answered by several gateways (other processes, or behind a proxy) have a row per gateway
    (`by_gateway`, keyed by the 200's Contact), with the CPU and /metrics figures of those in `watch`."""
    calls = len(schedule)
    workers = _children(gateway_pid)
    body0 = await asyncio.to_thread(scrape, http_port)
    watched0 = [await asyncio.to_thread(w.read) for w in watch]
    cpu0, wcpu0 = cpu_seconds(gateway_pid), {p: cpu_seconds(p) for p in workers}
    log_offset = log_path.stat().st_size
    killer = None
    if kill is not None:
        killer = asyncio.create_task(kill_worker(kill[0], time.time(), kill[1], log_path, http_port,
                                                 watch_s=timeout_s + 600))
    started, results = await asyncio.to_thread(place_schedule, schedule, processes, sip, timeout_s)
    wall = time.time() - started
    cpu = cpu_seconds(gateway_pid) - cpu0
    # The workers alive at the step's start that still are (a killed worker's CPU time leaves with it).
    worker_cpu = sum(cpu_seconds(p) - wcpu0[p] for p in workers if Path(f"/proc/{p}").exists())
    body1 = await asyncio.to_thread(scrape, http_port)
    watched1 = [await asyncio.to_thread(w.read) for w in watch]
    underruns = (metric_of(body1, "gateway_playout_underruns_total")
                 - metric_of(body0, "gateway_playout_underruns_total"))
    jobs = engine_jobs(log_path, log_offset)
    answered = [c for c in results if c.status == 200]
    workers_row: dict = {}
    users = {planned.index: planned.user for planned in schedule}
    if len(set(users.values())) > 1:
        workers_row["by_user"] = {}
        for user in dict.fromkeys(users.values()):
            group = [c for c in results if users[c.index] == user]
            ids = {c.call_id for c in group}
            group_jobs = [job for job in jobs if job["call_id"] in ids]
            workers_row["by_user"][user] = {"calls": len(group), "engine_jobs": len(group_jobs),
                                            **call_figures(group, group_jobs)}
    workers_row["prompt_cache"] = {name.removeprefix("gateway_prompt_cache_"): int(
        metric_of(body1, name) - metric_of(body0, name)) for name in CACHE_METRICS}
    by_gateway = {c.answered_by for c in answered}
    if len(by_gateway) > 1 or watch:  # several gateway processes: what each one's callers heard
        figures = {w.sip: (before, after) for w, before, after in zip(watch, watched0, watched1)}
        workers_row["by_gateway"] = {
            gateway: gateway_row([c for c in answered if c.answered_by == gateway], wall,
                                 *figures.get(gateway, (None, None)))
            for gateway in sorted(by_gateway | set(figures))}
    if kill is not None:
        assert killer is not None
        killed = await killer  # also waits for the worker to be back (for the next step)
        pids = {e["pid"]: e["worker"] for e in serve_events(log_path, ("engine_worker_started",))}
        # A job says its worker's pid when queued (tts_job_queued) and when it ends; a killed worker's calls
        # in flight have only the first.
        job_lines = serve_events(log_path, ("tts_job_queued", "tts_job_done", "tts_job_cancelled"), log_offset)
        all_jobs = [e for e in job_lines if str(e.get("call_id", "")).startswith("e2e-")]
        workers_row.update(kill=killed, **by_worker(answered, all_jobs, pids, kill[1]))
    return {"calls": calls, "rate_per_s": rate, "wall_s": round(wall, 2), **call_figures(results, jobs),
            "underruns": int(underruns),
            "gateway_cpu_s": round(cpu, 2), "gateway_cpu_ms_per_call": round(1000 * cpu / max(len(answered), 1), 1),
            "gateway_cpu_core_share": round(cpu / wall, 3), **clock_figures(body0, body1),
            "worker_cpu_s": round(worker_cpu, 2), "engine_workers": len(workers),
            "caller_processes": processes, "clock": "kernel SO_TIMESTAMPNS", **workers_row}


def start_serve(config: Path, log_path: Path) -> subprocess.Popen:
    """`cosyvoice-gateway serve --config` of this tree (PYTHONPATH first), its stderr log to `log_path`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=open(log_path, "w"), env=env)


def stop_serve(serve: subprocess.Popen) -> None:
    serve.send_signal(signal.SIGTERM)
    try:
        serve.wait(timeout=60)
    except subprocess.TimeoutExpired:
        serve.kill()


def compiled_graph_sets(config: dict) -> int:
    """How many compiled_graphs_complete lines a serve of `config` logs once at full speed: one per cosyvoice2
    engine (a worker is ready on graphs of the eager modules and swaps the compiled ones in while serving); none
    for one on the CPU, which has no graphs to compile (it is at full speed once ready)."""
    engine = config.get("engine", {})
    settings = engine.get("cosyvoice2") or {}
    if engine.get("name") != "cosyvoice2" or settings.get("device") == "cpu" or settings.get("graphs") is False:
        return 0
    return max(1, len(worker_names(config)))


def wait_serving(serve: subprocess.Popen, http_port: int, timeout_s: float, log_path: Path,
                 compiled: int = 0) -> None:
    """Until /healthz says 200 and, with `compiled`, that many engines have their compiled graphs in (the
    figures are the engine's at full speed; the eager phase after a start is measured by bench_worker_start);
    a serve that exits, or never gets there, fails with its log's tail."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if serve.poll() is not None:
            break
        try:
            wait_http(http_port, timeout=5.0)
        except RuntimeError:
            continue
        while compiled and time.monotonic() < end and serve.poll() is None:
            if len(serve_events(log_path, ("compiled_graphs_complete", "compiled_graphs_failed"))) >= compiled:
                return
            time.sleep(0.5)  # polling another process's log
        if not compiled:
            return
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise RuntimeError(f"serve not serving (exit code {serve.poll()}); its log ends:\n{tail}")


def base_config(args, sip_port: int, http_port: int, max_calls: int) -> dict:
    """The gateway config a bench serves, before its routes: `--config` (listen addresses and trunks replaced) or
    bench_calls' loopback config, with the engine options of the arguments."""
    if args.config:
        config = yaml.safe_load(Path(args.config).read_text())
        config.setdefault("sip", {})["listen"] = f"127.0.0.1:{sip_port}"
        config.setdefault("http", {})["listen"] = f"127.0.0.1:{http_port}"
        config["trunks"] = [{"name": "bench", "allow": ["127.0.0.0/8"]}]
    else:
        config = yaml.safe_load(gateway_config(sip_port, http_port, 1, max_calls, args.engine))
        if args.workers is not None:
            config["engine"]["workers"] = args.workers
        config["engine"].setdefault(args.engine, {})
        if args.engine == "instant":
            config["engine"]["instant"]["realtime"] = True  # a stream lasts as long as its audio, like a model
            config["engine"]["instant"]["first_chunk_delay_ms"] = args.first_chunk_delay_ms  # a model's first chunk
        config["engine"]["worker"] = {"slots": max_calls}
    if args.devices is not None:  # one worker per listed GPU (engine.cosyvoice2.devices)
        config["engine"].setdefault("cosyvoice2", {})["devices"] = list(args.devices)
        config["engine"].pop("workers", None)
    if args.max_first_audio_ms:
        config["engine"].setdefault("admission", {})["max_first_audio_ms"] = args.max_first_audio_ms
    return config


def config_text(args, sip_port: int, http_port: int, prompt_s: float, max_calls: int) -> tuple[str, dict]:
    """(the YAML a bench serves: `base_config` with the bench's routes, whose texts last `prompt_s` as the engine
    speaks them (`--prompt-length`, spoken_prompt.py), what that sizing gave)."""
    config = base_config(args, sip_port, http_port, max_calls)
    prompts = BenchPrompts(config, args.prompt_length)
    # Every call of the bench route asks the engine: route texts are cached unless they say not, and with the
    # cache every call after the first would be a hit (an H100 open-loop run measured 3 ms first audio, GPU idle).
    # A cached step's route is rendered into the prompt cache at start.
    config.setdefault("routes", []).insert(0, {"match": args.user, "text": prompts.text(prompt_s, "bench prompt "),
                                               "cache": False})
    if args.cached_calls:
        config["routes"].insert(0, {"match": args.cached_user, "prerender": True,
                                    "text": prompts.text(prompt_s, "cached prompt ")})
        config["sip"]["flood"] = {"max_requests_per_s_per_source": 100000, "max_requests_per_s": 100000}
    # A supervised engine worker logs at info whatever this says (the supervisor passes no --log-level), but an
    # in-process cosyvoice2 (workers: 0) follows it, and its tts_job_done lines are info.
    # --kill-worker-at reads the supervisor's engine_worker_* lines (info) too.
    info = config["engine"].get("name") == "cosyvoice2" or args.kill_worker_at is not None or bool(args.cached_calls)
    config["logging"] = {"level": "info" if info else "warning"}
    sizing = prompts.fit(config)
    return yaml.safe_dump(config, allow_unicode=True), sizing


async def run_steps(args, sip: tuple[str, int], http_port: int, pid: int, log_path: Path,
                    kill: tuple[float, str] | None) -> list[dict]:
    """The steps the arguments ask for against a serving gateway: --calls (constant --rate), then
    --cached-calls (each beside --uncached-calls, over --ramp-s)."""
    rows = []
    timeout_s = args.prompt_seconds * 3 + 30
    if args.cached_calls:  # the cached route is rendered in the background after start: wait for it
        deadline = time.monotonic() + args.start_timeout
        while not (done := serve_events(log_path, ("prerendered", "prerender_failed"))):
            if time.monotonic() > deadline:
                raise SystemExit(f"no prerendered line in {log_path} (logging.level must be info)")
            await asyncio.sleep(0.5)  # polling another process's log, not pacing media
        print(json.dumps({"prerender": {k: done[0].get(k) for k in ("event", "chars", "already_cached", "error")}}),
              flush=True)
    rates = args.rates or [args.rate] * len(args.calls)
    steps = [([PlannedCall(i, i / rate, args.user) for i in range(calls)], rate) for calls, rate in zip(args.calls, rates)]
    for cached in args.cached_calls:
        also = [(host, int(port)) for host, port in (address.rsplit(":", 1) for address in args.also_sip)]
        schedule = mixed_schedule(cached, args.uncached_calls, args.ramp_s, args.cached_user, args.user, also,
                                  args.hear_s)
        steps.append((schedule, round(len(schedule) / args.ramp_s, 1)))
    for step, (schedule, rate) in enumerate(steps, start=1):
        processes = args.caller_processes or max(1, math.ceil(len(schedule) / CALLS_PER_CALLER))
        step_kill = kill if args.kill_steps is None or step in args.kill_steps else None
        row = await run_step(schedule, processes, rate, sip, pid, timeout_s, http_port, log_path, step_kill,
                             [Watched.parse(text) for text in args.watch])
        print(json.dumps({k: v for k, v in row.items() if k != "per_call"}), flush=True)
        rows.append(row)
    return rows


async def main_async(args) -> dict:
    if args.sip:  # a gateway already serving (scripts/gpu_product.sh starts one serve for several benchmarks)
        host, port = args.sip.rsplit(":", 1)
        rows = await run_steps(args, (host, int(port)), args.http_port, args.serve_pid, args.serve_log, None)
        return {"config": f"a running serve (pid {args.serve_pid}, SIP {args.sip})", "prompt_seconds": args.prompt_seconds,
                "machine": f"{os.cpu_count()} cores", "steps": rows}
    with tempfile.TemporaryDirectory() as tmp:
        sip_port, http_port = free_port(), free_port(socket.SOCK_STREAM)
        cfg = Path(tmp) / "gateway.yaml"
        max_calls = max(args.calls + [c + args.uncached_calls for c in args.cached_calls]) + 50
        text, sizing = config_text(args, sip_port, http_port, args.prompt_seconds, max_calls)
        cfg.write_text(text)
        print(json.dumps({"prompts": sizing}), flush=True)
        log_path = args.serve_log or Path(tmp) / "serve.log"
        serve = start_serve(cfg, log_path)
        try:
            started = time.monotonic()
            await asyncio.to_thread(wait_serving, serve, http_port, args.start_timeout, log_path,
                                    compiled_graph_sets(yaml.safe_load(cfg.read_text())))
            compiled = serve_events(log_path, ("compiled_graphs_complete", "compiled_graphs_failed"))
            print(json.dumps({"serving_after_s": round(time.monotonic() - started, 1),
                              "compiled": [(e["event"], e.get("seconds")) for e in compiled]}), flush=True)
            kill = None
            if args.kill_worker_at is not None:
                names = worker_names(yaml.safe_load(cfg.read_text()))
                if not names:
                    raise SystemExit("--kill-worker-at needs supervised engine workers")
                kill = (args.kill_worker_at, names[min(args.kill_worker, len(names) - 1)])
            rows = await run_steps(args, ("127.0.0.1", sip_port), http_port, serve.pid, log_path, kill)
            if args.then:  # another benchmark against the same warm serve (a GPU start-up costs minutes)
                then = await asyncio.to_thread(subprocess.run, args.then, shell=True, cwd=ROOT)
                print(json.dumps({"then": args.then, "exit_code": then.returncode}), flush=True)
        finally:
            stop_serve(serve)
    delay = f", first chunk delay {args.first_chunk_delay_ms:g} ms" if args.engine == "instant" and not args.config else ""
    return {"config": args.config or f"bench_calls loopback config, engine {args.engine}, workers {args.workers}{delay}",
            "prompt_seconds": args.prompt_seconds, "prompts": sizing, "machine": f"{os.cpu_count()} cores",
            "steps": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="end-to-end concurrent calls, measured at the caller")
    parser.add_argument("--calls", type=int, nargs="*", default=[1, 50, 100])
    parser.add_argument("--cached-calls", type=int, nargs="*", default=[],
                        help="steps of this many calls to --cached-user, each beside --uncached-calls to --user")
    parser.add_argument("--uncached-calls", type=int, default=100)
    parser.add_argument("--ramp-s", type=float, default=15.0, help="a cached step's calls arrive over this long")
    parser.add_argument("--user", default="bench", help="the dialed user (the route) of --calls and uncached calls")
    parser.add_argument("--cached-user", default="cached", help="a route whose prompt the cache holds")
    parser.add_argument("--sip", help="HOST:PORT of a gateway already serving (with --http-port, --serve-pid, "
                                      "--serve-log): measure it instead of starting one")
    parser.add_argument("--also-sip", nargs="*", default=[], metavar="HOST:PORT",
                        help="other gateway processes of the host with the same routes and engine workers "
                             "(engine.remote): a cached step's calls go round-robin to --sip and these")
    parser.add_argument("--watch", nargs="*", default=[], metavar="SIPHOST:PORT,HTTP_PORT,PID",
                        help="gateway processes whose CPU and /metrics (clock lateness, GC) each step's by_gateway "
                             "row reports, by the SIP address their 200s' Contact names")
    parser.add_argument("--hear-s", type=float, default=None,
                        help="in cached steps, every caller hangs up this long after its first speech")
    parser.add_argument("--http-port", type=int, help="with --sip: its /metrics port")
    parser.add_argument("--serve-pid", type=int, help="with --sip: its pid (CPU time)")
    parser.add_argument("--rate", type=float, default=10.0, help="new calls per second")
    parser.add_argument("--rates", type=float, nargs="+", default=None,
                        help="new calls per second for each step of --calls (instead of one --rate for all)")
    parser.add_argument("--prompt-seconds", type=float, default=6.0, help="how long a call's prompt is spoken")
    parser.add_argument("--prompt-length", choices=PROMPT_LENGTHS, default="spoken",
                        help="spoken: the text lasts --prompt-seconds as the engine speaks it (cosyvoice2: the "
                             "full-size random model, max_len raised to fit; spoken_prompt.py); chars: 60 ms a "
                             "character for every engine (the benches before: a 30-s cosyvoice2 call ended at 11.5 s)")
    parser.add_argument("--engine", default="instant", help="without --config: instant, espeak or cosyvoice2")
    parser.add_argument("--workers", type=int, default=None, help="without --config: engine.workers")
    parser.add_argument("--first-chunk-delay-ms", type=float, default=0.0,
                        help="without --config, engine instant: its first chunk this late (a model's, e.g. 70)")
    parser.add_argument("--config", help="a gateway YAML to serve (its sip/http listen and trunks are replaced)")
    parser.add_argument("--max-first-audio-ms", type=float, default=None, help="engine.admission bound")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--caller-processes", type=int, default=None,
                        help=f"processes placing the calls (default: one per {CALLS_PER_CALLER} calls of the step)")
    parser.add_argument("--out", type=Path, default=RESULTS / "e2e_calls.json")
    parser.add_argument("--serve-log", type=Path, default=None, help="keep the gateway's log here")
    parser.add_argument("--then", help="a shell command to run after the steps, while serve still serves")
    parser.add_argument("--devices", type=int, nargs="+", default=None,
                        help="cosyvoice2: one supervised worker per listed GPU (engine.cosyvoice2.devices)")
    parser.add_argument("--kill-worker-at", type=float, default=None, metavar="SECONDS",
                        help="in every step, kill -9 one engine worker this long after the step began, and report "
                             "per call which worker served it and the killed worker's calls apart from the others'")
    parser.add_argument("--kill-steps", type=int, nargs="+", default=None, metavar="STEP",
                        help="with --kill-worker-at: kill only in these steps (1 = the first of --calls), not every one")
    parser.add_argument("--kill-worker", type=int, default=1, metavar="INDEX",
                        help="the worker --kill-worker-at kills (index in config order; default 1, the second GPU)")
    args = parser.parse_args(argv)
    if args.rates is not None and len(args.rates) != len(args.calls):
        parser.error(f"--rates gives {len(args.rates)} rates for {len(args.calls)} steps of --calls")
    if args.sip and not (args.http_port and args.serve_pid and args.serve_log):
        parser.error("--sip needs --http-port, --serve-pid and --serve-log")
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
