"""Open-loop load, gated on zero underruns: the highest arrival rate a server sustains for real-time listeners.

Requests arrive as a Poisson process at each rate of `--rates` (new requests/s), one run per (rate, seed):
`--warmup` seconds of arrivals that are not measured (default: the longest prompt, so concurrency has reached
rate x prompt length), then a `--window` whose every arrival is measured to its end, then a tail of the same
load until the window's requests are done (tail requests hang up at its end). Arrivals never wait for answers
(arrivals.py), so a server that falls behind faces a growing queue instead of a politely slowing client, as it
would in service. Each request's text is drawn (seeded) from `--prompt-seconds` (SIP) or `--api-prompt-seconds`
(texts that long as the engine speaks them: `--prompt-length`, spoken_prompt.py; at 30 s the full-size random
CosyVoice model gets a 52-character text it speaks for 30.4 s, with max_len raised to 1024). One `serve`
(bench_e2e_calls' config helpers: `--config`, or the loopback config with `--engine`/`--workers`) serves the whole
sweep, two ways in:

  sip  raw-SIP calls from spawned callers (e2e_caller.py, RTP timed by the kernel): first audible audio (INVITE
       -> first RTP payload at or over -40 dBFS once G.711-decoded, audible.py), RTP intervals, gaps over 60 ms,
       the gateway's playout underruns per measured call (its media_closed log line: silent slots, the times
       playout ran dry, how much a call had heard when it first did) and over the window
       (gateway_playout_underruns_total, sampled every 0.5 s), refusals (503 and any other non-200).
  api  POST /v1/tts on the supervised workers' speech API (pcm_s16le; api_stream.py): first audible audio,
       received audio x real time, and underruns of a client playback buffer that starts at the first audible
       audio (open_loop_gate.py), refusals. The client is this one process (times from its loop, not the
       kernel's): on a small shared box a late client reads as a late server, so compare where it is idle.

The gate (open_loop_gate.py), per run: nothing refused or unfinished, zero underruns, zero gaps over 60 ms,
first audible audio p95 <= `--max-first-audio-p95-ms` (300). A rate passes when all its seeds do; the highest
passing rate (every rate below it passing too) is the result.

    python bench/bench_open_loop.py --engine instant --workers 1 --first-chunk-delay-ms 70 --rates 1 3 10 \\
        --seeds 1 2 --window 20 --api-sample-rate 8000      # the 2-core box (open_loop_instant.json)
    python bench/bench_open_loop.py --config gpu.yaml --rates 5 10 15 20   # a GPU host: 3 seeds, 300-s windows

Results: bench/results/open_loop_<engine>.json (every run's figures, the highest passing rate, the command).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import shlex
import socket
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from api_stream import ApiResult, PlannedRequest, stream_requests  # noqa: E402
from arrivals import TAIL, WINDOW, Arrival, plan_arrivals  # noqa: E402
from bench_calls import free_port, metric, scrape  # noqa: E402
from bench_e2e_calls import (base_config, clock_figures, compiled_graph_sets, first_chunk_stages,  # noqa: E402
                             start_serve, stop_serve, wait_serving, worker_names)
from engine_log import job_events, serve_events  # noqa: E402
from e2e_caller import CallResult, PlannedCall, place_schedule  # noqa: E402
from open_loop_gate import GAP_MS, Outcome, highest_passing_rate, playback_underruns, run_figures  # noqa: E402
from spoken_prompt import PROMPT_LENGTHS, BenchPrompts  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CALLS_PER_CALLER = 100  # as bench_e2e_calls
TAIL_SLACK_S = 5.0  # the tail outlasts the longest prompt by this: the window's last request's first audio


def route_user(seconds: float) -> str:
    return f"ol{round(seconds * 1000)}"


def serve_config(args, sip_port: int, http_port: int, api_port: int, key: str) -> tuple[dict, dict[float, str], dict]:
    """(bench_e2e_calls' base config, plus a route per SIP prompt length, the workers' speech API on `api_port` and
    logging at info (the gateway's media_closed lines carry each call's underruns); the speech API's text per
    length; what the prompt sizing gave (spoken_prompt.BenchPrompts.fit))."""
    config = base_config(args, sip_port, http_port, args.max_calls)
    prompts = BenchPrompts(config, args.prompt_length)
    words = "open loop prompt "
    # cache: false: every call asks the engine (route texts are kept by the prompt cache unless they say not)
    config["routes"] = [{"match": route_user(s), "text": prompts.text(s, words), "cache": False}
                        for s in args.prompt_seconds]
    api_texts = {s: prompts.text(s, words) for s in args.api_prompt_seconds}
    config.setdefault("sip", {}).setdefault("max_calls", args.max_calls)
    config["sip"]["flood"] = {"max_requests_per_s_per_source": 100000, "max_requests_per_s": 100000}
    if worker_names(config):
        # Every request comes from this one address: the worker port's per-source cap (64) would refuse the load
        # generator, not measure the server (as bench_calls lifts sip.flood for SIPp).
        config["engine"].setdefault("worker", {}).update(port=api_port, max_connections=100000,
                                                         max_connections_per_source=100000)
        config["tts_api"] = {**config.get("tts_api", {}), "api_keys": [
            {"name": "openloop", "key": key, "max_streams": 100000}]}
    config["logging"] = {"level": "info"}
    return config, api_texts, prompts.fit(config)


class MetricSampler:
    """gateway_playout_underruns_total every 0.5 s while a run goes: the window's delta is read afterwards from
    the samples around its edges (the callers' start time is known only once they are all ready)."""

    def __init__(self, http_port: int) -> None:
        self.http_port = http_port
        self.samples: list[tuple[float, float]] = []

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            value = await asyncio.to_thread(metric, self.http_port, "gateway_playout_underruns_total")
            self.samples.append((time.time(), value))
            try:
                await asyncio.wait_for(stop.wait(), 0.5)  # a sampling period, not media pacing
            except TimeoutError:
                pass

    def delta(self, start: float, end: float) -> int | None:
        before = [v for t, v in self.samples if t <= start]
        after = [v for t, v in self.samples if t >= end]
        return int(after[0] - before[-1]) if before and after else None


async def wait_calls_idle(http_port: int, timeout_s: float) -> None:
    """Until the gateway has no call left (the last run's tail), so runs do not share load."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and await asyncio.to_thread(metric, http_port, "gateway_calls_active") > 0:
        await asyncio.sleep(0.5)  # polling another process's state between runs


def sip_outcome(call: CallResult, underruns: int | None) -> Outcome:
    if call.status != 200 or call.reason == "timeout":
        return Outcome(refusal=f"{call.status} {call.reason}".strip() if call.status != 200 else "unfinished (timeout)")
    arrivals = np.frombuffer(call.arrivals_ns, dtype=np.int64)
    intervals = np.diff(arrivals) / 1e6
    first = None if call.first_audible_ns is None else (call.first_audible_ns - call.invite_ns) / 1e6
    xrt = len(arrivals) * 0.02 / ((arrivals[-1] - call.invite_ns) / 1e9) if len(arrivals) else None
    return Outcome(first_audible_ms=first, x_real_time=xrt, underruns=underruns or 0,
                   gaps_over_60ms=int((intervals > GAP_MS).sum()), rtp_intervals_ms=tuple(intervals.tolist()))


def api_outcome(result: ApiResult) -> Outcome:
    if result.status != 200:
        try:
            reason = json.loads(result.reason).get("error", "")
        except ValueError:
            reason = result.reason[:60]
        return Outcome(refusal=f"{result.status} {reason}".strip())
    if not result.complete:
        return Outcome(refusal=f"unfinished ({result.reason[:60]})")
    if result.first_audible_s is None:
        return Outcome()
    underruns, _ = playback_underruns(result.chunks, result.first_audible_s, result.audible_audio_s)
    last_at, audio_s = result.chunks[-1]
    return Outcome(first_audible_ms=1000 * (result.first_audible_s - result.sent_s),
                   x_real_time=audio_s / (last_at - result.sent_s), underruns=underruns)


def dry_spells(closed: list[dict]) -> dict:
    """How the measured calls' playout ran dry (the gateway's media_closed lines): the times it did, and how much
    of its prompt a call had heard when it first did (p10 / p50 / p90 over the calls that did)."""
    firsts = [e["first_underrun_s"] for e in closed if e.get("first_underrun_s") is not None]
    spread = ({f"p{q}": round(float(np.percentile(firsts, q)), 2) for q in (10, 50, 90)} if firsts else None)
    return {"underrun_events": sum(e.get("underrun_events") or 0 for e in closed), "first_underrun_s": spread}


async def run_sip(args, arrivals: list[Arrival], phases: tuple[float, float], sip: tuple[str, int],
                  http_port: int, log_path: Path) -> dict:
    warmup, end_s = phases
    schedule = [PlannedCall(a.index, a.at_s, route_user(a.prompt_s), end_s - a.at_s if a.phase == TAIL else None)
                for a in arrivals]
    concurrent = len(arrivals) / end_s * max(args.prompt_seconds)
    processes = args.caller_processes or max(1, math.ceil(concurrent / CALLS_PER_CALLER))
    sampler, stop = MetricSampler(http_port), asyncio.Event()
    sampling = asyncio.create_task(sampler.run(stop))
    offset = log_path.stat().st_size
    body0 = await asyncio.to_thread(scrape, http_port)
    started, results = await asyncio.to_thread(place_schedule, schedule, processes, sip,
                                               max(args.prompt_seconds) * 2 + 30)
    body1 = await asyncio.to_thread(scrape, http_port)
    stop.set()
    await sampling
    closed = {e.get("call_id"): e for e in serve_events(log_path, ("media_closed",), offset)}
    measured = [r for r, a in zip(results, arrivals, strict=True) if a.phase == WINDOW]
    window = sampler.delta(started + warmup, started + warmup + args.window)
    figures = run_figures([sip_outcome(c, closed.get(c.call_id, {}).get("underruns")) for c in measured], window,
                          args.max_first_audio_p95_ms)
    figures.update(dry_spells([closed[c.call_id] for c in measured if c.call_id in closed]))
    # Where the measured calls' first chunks went, from the engine's own job lines (cosyvoice2 workers).
    ids = {c.call_id for c in measured}
    jobs = [e for e in job_events(log_path, offset)[0] if e["event"] == "tts_job_done" and e.get("call_id") in ids]
    engine = {}
    if jobs:
        first = [e["first_chunk_s"] * 1e3 for e in jobs]
        engine = {"engine_first_chunk_ms": {"p50": round(float(np.percentile(first, 50)), 1),
                                            "p95": round(float(np.percentile(first, 95)), 1), "jobs": len(jobs)},
                  "engine_first_chunk_stages_ms": first_chunk_stages(jobs),
                  "engine_first_render_split_ms": first_chunk_stages(jobs, "first_render_"),
                  # How soon the second chunk followed the first, against that one's audio (its margin; below 0
                  # the call ran dry there): what a shorter first hop must beat under load.
                  "engine_second_chunk_ms": first_chunk_stages(
                      [e for e in jobs if "second_chunk_after_ms" in e], "second_chunk_")}
    # The gateway's own view over the whole run (warm-up to tail): a gap at the caller with the packet clock on
    # time is the network's or the caller's; with the clock late or a long GC, the gateway's.
    return {**figures, "caller_processes": processes, **engine, "gateway": clock_figures(body0, body1),
            "calls_without_media_closed_line": sum(1 for c in measured if c.status == 200 and c.call_id not in closed)}


async def run_api(args, arrivals: list[Arrival], end_s: float, urls: list[str], key: str,
                  texts: dict[float, str]) -> dict:
    schedule = [PlannedRequest(a.index, a.at_s, texts[a.prompt_s], end_s - a.at_s if a.phase == TAIL else None)
                for a in arrivals]
    start_at = time.time() + 0.2
    shares = [stream_requests(url, key, schedule[i::len(urls)], start_at, args.api_sample_rate,
                              max(args.api_prompt_seconds) * 2 + 30) for i, url in enumerate(urls)]
    results = sorted((r for share in await asyncio.gather(*shares) for r in share), key=lambda r: r.index)
    measured = [r for r, a in zip(results, arrivals, strict=True) if a.phase == WINDOW]
    return run_figures([api_outcome(r) for r in measured], None, args.max_first_audio_p95_ms)


async def main_async(args) -> dict:
    report: dict = {"command": shlex.join(["python", *sys.argv]), "date": time.strftime("%Y-%m-%d %H:%M"),
                    "machine": f"{os.cpu_count()} cores", "method": {
                        "arrivals": "Poisson", "warmup_s": args.warmup or "the longest prompt", "window_s": args.window,
                        "tail_s": f"the longest prompt + {TAIL_SLACK_S:g}", "seeds": args.seeds,
                        "sip_prompt_seconds": args.prompt_seconds, "api_prompt_seconds": args.api_prompt_seconds,
                        "api_sample_rate": args.api_sample_rate, "audible": "20 ms frame RMS >= -40 dBFS",
                        "gate": f"no refusal or unfinished request, zero underruns, zero RTP gaps > {GAP_MS:g} ms, "
                                f"first audible p95 <= {args.max_first_audio_p95_ms:g} ms; a rate passes when all "
                                "its seeds do"}}
    with tempfile.TemporaryDirectory() as tmp:
        sip_port, http_port, api_port = free_port(), free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
        key = secrets.token_hex(16)
        config, api_texts, report["prompts"] = serve_config(args, sip_port, http_port, api_port, key)
        print(json.dumps({"prompts": report["prompts"]}), flush=True)
        report["engine"] = config["engine"].get("name")
        report["config"] = args.config or (f"bench_calls loopback config, engine {args.engine}, workers "
                                           f"{args.workers}, first chunk delay {args.first_chunk_delay_ms:g} ms")
        cfg = Path(tmp) / "gateway.yaml"
        cfg.write_text(yaml.safe_dump(config, allow_unicode=True))
        log_path = args.serve_log or Path(tmp) / "serve.log"
        workers = len(worker_names(config))
        if "api" in args.modes and not workers:
            raise SystemExit("--modes api needs supervised engine workers (--workers N, or a cosyvoice2 config)")
        urls = [f"http://127.0.0.1:{api_port + i}" for i in range(workers)]
        serve = start_serve(cfg, log_path)
        try:
            await asyncio.to_thread(wait_serving, serve, http_port, args.start_timeout, log_path,
                                    compiled_graph_sets(config))
            for mode in args.modes:
                prompts = args.prompt_seconds if mode == "sip" else args.api_prompt_seconds
                warmup = max(prompts) if args.warmup is None else args.warmup
                rows = []
                for rate in args.api_rates if mode == "api" and args.api_rates else args.rates:
                    for seed in args.seeds:
                        await wait_calls_idle(http_port, max(args.prompt_seconds) + 60)
                        tail_s = max(prompts) + TAIL_SLACK_S
                        end_s = warmup + args.window + tail_s
                        arrivals = plan_arrivals(rate, seed, warmup, args.window, tail_s, prompts)
                        if mode == "sip":
                            figures = await run_sip(args, arrivals, (warmup, end_s), ("127.0.0.1", sip_port),
                                                    http_port, log_path)
                        else:
                            figures = await run_api(args, arrivals, end_s, urls, key, api_texts)
                        row = {"rate_per_s": rate, "seed": seed, "warmup_s": warmup, "arrivals": len(arrivals),
                               **figures}
                        print(json.dumps({"mode": mode, **row}), flush=True)
                        rows.append(row)
                report[mode] = {"highest_passing_rate_per_s": highest_passing_rate(rows), "runs": rows}
        finally:
            stop_serve(serve)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--modes", nargs="+", choices=["sip", "api"], default=["sip", "api"])
    parser.add_argument("--rates", type=float, nargs="+", default=[2.0, 5.0, 10.0], help="new requests per second")
    parser.add_argument("--api-rates", type=float, nargs="+", default=None,
                        help="the speech API's rates, where they differ from --rates (one start-up for both modes)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--warmup", type=float, default=None,
                        help="seconds of arrivals before the window (default: the longest prompt, so the window "
                             "starts at the steady state's concurrency, rate x prompt length)")
    parser.add_argument("--window", type=float, default=300.0, help="seconds whose arrivals are measured")
    parser.add_argument("--prompt-seconds", type=float, nargs="+", default=[30.0],
                        help="SIP: prompt lengths to draw from (seconds of speech, sized by --prompt-length)")
    parser.add_argument("--api-prompt-seconds", type=float, nargs="+", default=[3.0, 10.0, 30.0],
                        help="speech API: text lengths to draw from (a mix: replies and announcements)")
    parser.add_argument("--prompt-length", choices=PROMPT_LENGTHS, default="spoken",
                        help="spoken: texts last their seconds as the engine speaks them (cosyvoice2: the full-size "
                             "random model, max_len raised to fit); chars: 60 ms a character (before: a 30-s "
                             "cosyvoice2 call ended at 11.5 s)")
    parser.add_argument("--max-first-audio-p95-ms", type=float, default=300.0)
    parser.add_argument("--api-sample-rate", type=int, default=24000, choices=[8000, 16000, 24000])
    parser.add_argument("--engine", default="instant", help="without --config: instant, espeak or cosyvoice2")
    parser.add_argument("--workers", type=int, default=None, help="without --config: engine.workers")
    parser.add_argument("--first-chunk-delay-ms", type=float, default=0.0,
                        help="without --config, engine instant: its first chunk this late (a model's, e.g. 70)")
    parser.add_argument("--config", help="a gateway YAML to serve (its sip/http listen and trunks are replaced)")
    parser.add_argument("--devices", type=int, nargs="+", default=None,
                        help="cosyvoice2: one supervised worker per listed GPU (engine.cosyvoice2.devices)")
    parser.add_argument("--max-first-audio-ms", type=float, default=None, help="engine.admission bound")
    parser.add_argument("--max-calls", type=int, default=1000, help="sip.max_calls (and the instant worker's slots)")
    parser.add_argument("--caller-processes", type=int, default=None,
                        help=f"SIP caller processes (default: one per {CALLS_PER_CALLER} concurrent calls)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--serve-log", type=Path, default=None, help="keep the gateway's log here")
    parser.add_argument("--out", type=Path, default=None, help="default bench/results/open_loop_<engine>.json")
    args = parser.parse_args(argv)
    report = asyncio.run(main_async(args))
    out = args.out or RESULTS / f"open_loop_{report['engine']}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for mode in args.modes:
        print(f"{mode}: highest rate passing the gate: {report[mode]['highest_passing_rate_per_s']} /s")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
