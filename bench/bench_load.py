"""A call-center day in miniature: Poisson arrivals of short TTS requests on one scheduler.

For each arrival rate of a sweep, requests arrive as a Poisson process for `--duration` seconds:
texts of 8-60 characters, Chinese or English, in voice `bench_voice` (150 prompt tokens) of a
full-size random-weight model (bench/full_model.py). Random weights rarely say stop, so each
request's speech-token count is fixed from its text (~5 tokens per Chinese character, 1.5 per
English one, bounded) with JobOptions(min_tokens=max_tokens): runs are comparable.

Per rate: first-chunk latency p50/p95/p99 (submit -> first chunk handed to the sink), underruns (a
chunk handed over after the audio before it has finished playing, on a playout clock per stream
that starts at its first chunk), per-stream RTF, mean/peak concurrent streams, GPU memory. The
report names the largest concurrency whose p95 first chunk is <= 300 ms with zero underruns, and
splits one lone request's first chunk (frontend, prefill, decode, flow, HiFT, hand-off).
A call plays for several seconds, so a short `--duration` ends before the load reaches its steady
state and flatters the result (H100: 14 req/s passes with 10 s of arrivals, 12 fails with 15 s;
docs/PERF_NOTES.md). Compare runs only at equal durations. `--settle-s S` judges each rate on the
requests that arrive after S seconds, and counts calls playing over that window only (`steady`):
e.g. `--duration 30 --settle-s 10`.

    python bench/bench_load.py                        # CUDA, bf16, graphs, full-size model in /tmp
    python bench/bench_load.py --model-dir ../shared/golden/cosyvoice2_tiny --device cpu \\
        --rates 2 --duration 1 --min-tokens 20 --max-tokens 40     (seconds, the test's settings)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import faulthandler
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from tts_core.accel import resolve_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_trace
from host_waits import HostWaits

REPO = Path(__file__).resolve().parents[1]
# The decode thread's iterations (tts_core.runtime.scheduler.StepTiming), from the hook main installs.
STEPS: collections.deque = collections.deque(maxlen=10_000)
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices, resolved by tts_core.accel.resolve_dtype
ZH = "您好欢迎致电客服中心请问有什么可以帮您的我们将尽快为您处理订单查询退款预约服务时间地址电话谢谢再见稍等正在转接人工"
EN = ("hello thank you for calling your order has shipped please hold the line we will be with you shortly "
      "press one for billing two for support your appointment is confirmed for tomorrow at nine").split()
SAMPLE_RATE = 24_000


def make_text(rng: random.Random) -> tuple[str, str]:
    length = rng.randint(8, 60)
    if rng.random() < 0.5:
        return "zh", "".join(rng.choice(ZH) for _ in range(length))
    words: list[str] = []
    while len(" ".join(words)) < length:
        words.append(rng.choice(EN))
    return "en", " ".join(words)[:length].strip()


def token_count(lang: str, text: str, lo: int, hi: int) -> int:
    per_char = 5.0 if lang == "zh" else 1.5
    return max(lo, min(hi, round(len(text) * per_char)))


class TimedSink:
    """Records when each chunk arrives (the scheduler's render thread) and lets the driver wait for the end."""

    def __init__(self) -> None:
        self.arrivals: list[tuple[float, int]] = []  # (perf_counter, samples)
        self.error: BaseException | None = None
        self.done = threading.Event()

    cancelled = False

    def put(self, chunk: np.ndarray) -> None:
        self.arrivals.append((time.perf_counter(), len(chunk)))

    def finish(self) -> None:
        self.done.set()

    def fail(self, error: BaseException) -> None:
        self.error = error
        self.done.set()


def underruns(submitted: float, arrivals: list[tuple[float, int]]) -> int:
    """Chunks that arrive after the audio before them finished playing (playout from chunk 0)."""
    if not arrivals:
        return 0
    start, played, late = arrivals[0][0], 0.0, 0
    for at, samples in arrivals:
        if at > start + played + 1e-4:
            late += 1
            start = at - played  # the caller heard a gap; playout resumes when the chunk lands
        played += samples / SAMPLE_RATE
    return late


def playout_end(arrivals: list[tuple[float, int]]) -> float:
    """When the last sample has played (playout from chunk 0, resuming late chunks on arrival)."""
    end = arrivals[0][0]
    for at, samples in arrivals:
        end = max(end, at) + samples / SAMPLE_RATE
    return end


def peak_overlap(spans: list[tuple[float, float]]) -> int:
    edges = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    level = peak = 0
    for _, step in edges:
        level += step
        peak = max(peak, level)
    return peak


def in_window(spans: list[tuple[float, float]], start: float, end: float) -> tuple[float, int]:
    """(mean, peak) of how many spans overlap [start, end]: the load while arrivals are steady, not
    during the ramp up before it or the drain after it."""
    clipped = [(max(s, start), min(e, end)) for s, e in spans if e > start and s < end]
    mean = sum(e - s for s, e in clipped) / (end - start) if end > start else 0.0
    return mean, peak_overlap(clipped)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def latency_ms(seconds: list[float]) -> dict[int, float]:
    """p50/p95/p99 in ms (0 without values)."""
    return {q: (percentile(seconds, q) or 0) * 1e3 for q in (50, 95, 99)}


def run_rate(pipeline, voice: str, rate: float, duration: float, rng: random.Random, lo: int, hi: int,
             timeout: float, settle: float = 0.0, profile: tuple[float, float] | None = None) -> dict:
    """`profile` (from_s, seconds): record the GPU's kernels over that stretch of the arrivals."""
    from tts_core.runtime import JobOptions

    gaps, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > duration:
            break
        gaps.append(t)
    requests = []
    wake = threading.Event()  # never set: waits until each arrival time without a busy loop
    started = time.perf_counter()
    active_samples = []
    profiled: dict = {}
    if profile is not None:
        from_s, seconds = profile

        def trace() -> None:
            time.sleep(max(0.0, started + from_s - time.perf_counter()))
            profiled["prof"] = gpu_trace.record(lambda: time.sleep(seconds))

        # CUPTI records every thread's streams, so the profiler may run beside the arrivals.
        tracer = threading.Thread(target=trace, name="bench-gpu-trace", daemon=True)
        tracer.start()
    for at in gaps:
        delay = started + at - time.perf_counter()
        if delay > 0:
            wake.wait(delay)
        lang, text = make_text(rng)
        n = token_count(lang, text, lo, hi)
        sink = TimedSink()
        job = pipeline.synthesize(text, voice, sink, JobOptions(min_tokens=n, max_tokens=n), call_id=f"r{len(requests)}")
        requests.append((job, sink, n, lang, at))
        active_samples.append(pipeline.scheduler.active_jobs)
    deadline = time.perf_counter() + timeout
    for _, sink, _, _, _ in requests:
        sink.done.wait(max(0.0, deadline - time.perf_counter()))
    wall = time.perf_counter() - started
    if profile is not None:
        tracer.join()
        profiled = {**gpu_trace.summary(profiled.pop("prof")), "from_s": profile[0], "seconds": profile[1]}
    first, rtf, late, failed, busy, playing = [], [], 0, 0, [], []
    steady_first, steady_late = [], 0  # requests that arrived after `settle`
    for job, sink, n, _, at in requests:
        if sink.error is not None or not sink.done.is_set() or not sink.arrivals:
            failed += 1
            continue
        submitted = job.timings.submitted
        first.append(sink.arrivals[0][0] - submitted)
        audio = sum(s for _, s in sink.arrivals) / SAMPLE_RATE
        rtf.append((sink.arrivals[-1][0] - submitted) / audio)
        gaps_heard = underruns(submitted, sink.arrivals)
        late += gaps_heard
        if at >= settle:
            steady_first.append(first[-1])
            steady_late += gaps_heard
        busy.append((submitted, sink.arrivals[-1][0]))
        playing.append((submitted, playout_end(sink.arrivals)))
    steady_playing = in_window(playing, started + settle, started + duration)
    # Mean concurrency = total stream-seconds / span of the run; peak from the submit-time samples.
    # "Streams" are requests being synthesised (submit -> last chunk); "playing" are calls from
    # submit until their audio has played out (what a call center counts as calls speaking).
    span = (max(e for _, e in busy) - min(s for s, _ in busy)) if busy else 1.0
    mean_conc = sum(e - s for s, e in busy) / span if busy else 0.0
    play_span = (max(e for _, e in playing) - min(s for s, _ in playing)) if playing else 1.0
    steps = list(STEPS)
    renders = list(pipeline.scheduler.renders)
    done = [job for job, sink, _, _, _ in requests if sink.error is None and sink.done.is_set() and sink.arrivals]
    return {
        "rate_per_s": rate, "requests": len(requests), "failed": failed, "wall_s": wall,
        "first_chunk_ms": latency_ms(first),
        "underruns": late, "rtf_mean": float(np.mean(rtf)) if rtf else None, "rtf_max": max(rtf, default=None),
        "concurrency_mean": mean_conc, "concurrency_peak": max(active_samples, default=0),
        "playing_mean": sum(e - s for s, e in playing) / play_span if playing else 0.0,
        "playing_peak": peak_overlap(playing),
        # From `settle` s into the rate's arrivals to their end: the load in its steady state.
        "steady": {"from_s": settle, "to_s": duration, "requests": len(steady_first),
                   "first_chunk_ms": latency_ms(steady_first),
                   "underruns": steady_late, "playing_mean": steady_playing[0], "playing_peak": steady_playing[1]},
        "decode_batch_max": max((s.batch for s in steps), default=0),
        # Rows per launched step and rows stepped in all (streams far ahead sit steps out: yield_lead_s).
        "decode_batch_mean": float(np.mean([s.batch for s in steps if s.batch])) if any(s.batch for s in steps) else 0.0,
        "decode_rows": sum(s.batch for s in steps),
        "steps": len(steps), "step_ms_mean": 1e3 * wall / max(1, len(steps)),
        "decode_ms_mean": 1e3 * float(np.mean([s.decode_s for s in steps])) if steps else None,
        "decode_thread": decode_thread_split(steps),
        "first_chunk_split": first_chunk_stages(done),
        "first_chunk_render": first_chunk_render(done),
        # The render threads run beside the decode thread: per lane, the share of the wall time it rendered.
        "render": {lane: {"busy_fraction": sum(r.seconds for r in mine) / wall,
                          "ms_mean": 1e3 * float(np.mean([r.seconds for r in mine])),
                          "flow_ms_mean": 1e3 * float(np.mean([r.flow_s for r in mine])),
                          "hift_ms_mean": 1e3 * float(np.mean([r.hift_s for r in mine])),
                          "calls": len(mine), "chunks_per_call": sum(r.chunks for r in mine) / len(mine)}
                   for lane in sorted({r.lane for r in renders})
                   for mine in [[r for r in renders if r.lane == lane]]},
        "gpu_mem_gb": torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None,
        "eager_flow_calls": eager_flow_calls(pipeline),
        **({"gpu_trace": profiled} if profile is not None else {}),
    }


def decode_thread_split(steps) -> dict:
    """Mean ms per decode-thread iteration that did work, by part: what a first chunk's 28 tokens
    wait on, step after step."""
    if not steps:
        return {}
    parts = {"iteration": [s.wall_s for s in steps], "prefill_admit": [s.prefill_s for s in steps],
             "decode": [s.decode_s for s in steps],
             "decode_wait": [s.wait_s for s in steps], "first_token_wait": [s.first_wait_s for s in steps]}
    out = {f"{k}_ms_mean": 1e3 * float(np.mean(v)) for k, v in parts.items()}
    out["iteration_ms_p95"] = 1e3 * float(np.percentile(parts["iteration"], 95))
    out["with_prefill"] = sum(1 for s in steps if s.prefills) / len(steps)
    return out


def first_chunk_render(jobs) -> dict:
    """A first chunk's render stage split, mean and p95 (ms): the flow call's wall time, its
    encoder's and solve's time on the lane's CUDA stream (where timed: graphed flows), and HiFT
    with the hand-off to the host. Stream time against wall time tells a GPU kept busy by the
    other streams' kernels from a host that launched late."""
    rows = [{k: v for k, v in first_chunk_parts(job).items() if k in ("flow", "hift")} | first_chunk_stream_times(job)
            for job in jobs if job.timings.chunks]
    keys = [k for k in ("flow", "flow_encoder_gpu", "flow_solve_gpu", "hift", "hift_launch", "hift_gpu")
            if rows and all(k in r for r in rows)]
    if not keys:
        return {}
    values = {k: 1e3 * np.array([r[k] for r in rows]) for k in keys}
    return {"mean_ms": {k: round(float(v.mean()), 1) for k, v in values.items()},
            "p95_ms": {k: round(float(np.percentile(v, 95)), 1) for k, v in values.items()}}


def first_chunk_stages(jobs) -> dict:
    """Where each request's first-chunk latency went, mean and p95 per stage (ms), and the mean
    split of the slowest 5 % of requests."""
    from tts_core.runtime.request import FIRST_CHUNK_STAGES

    rows = []
    for job in jobs:
        stages = job.timings.first_chunk_stages()
        if stages is not None:
            rows.append(list(stages.values()))
    if not rows:
        return {}
    a = 1e3 * np.array(rows)
    names = [name for name, _ in FIRST_CHUNK_STAGES]
    slow = a[a.sum(1) >= np.percentile(a.sum(1), 95)]
    return {"mean_ms": dict(zip(names, a.mean(0).round(1).tolist())),
            "p95_ms": dict(zip(names, np.percentile(a, 95, axis=0).round(1).tolist())),
            "slowest_5pct_mean_ms": dict(zip(names, slow.mean(0).round(1).tolist()))}


def one_stream(pipeline, voice: str, requests: int, rng: random.Random, lo: int, hi: int) -> dict:
    """Requests one at a time (each after the previous finished): first-chunk latency p50/p95 of a
    lone stream, and the median time split (the goal is the p50, so one request is not enough)."""
    from tts_core.runtime import CollectingSink, JobOptions

    firsts, splits = [], []
    for i in range(requests):
        lang, text = make_text(rng)
        n = token_count(lang, text, lo, hi)
        sink = CollectingSink()
        job = pipeline.synthesize(text, voice, sink, JobOptions(min_tokens=n, max_tokens=n), call_id=f"one{i}")
        sink.wait(600)
        firsts.append(job.timings.since_submit(job.timings.first_chunk))
        splits.append(first_chunk_parts(job) | first_chunk_stream_times(job))
    ms = 1e3 * np.array(firsts)
    return {"requests": requests, "first_chunk_ms": {q: float(np.percentile(ms, q)) for q in (50, 95)},
            "first_chunk_ms_min": float(ms.min()), "first_chunk_ms_max": float(ms.max()),
            "median_split_ms": {k: 1e3 * float(np.median([s[k] for s in splits if k in s]))
                                for k in dict.fromkeys(k for s in splits for k in s)}}


def eager_flow_calls(pipeline) -> dict:
    """Per lane, flow solves and encoder calls so far that found no captured graph (graphs only;
    CosyVoice3's DiT lanes capture solves only, their flow encoder always runs eagerly)."""
    lanes = pipeline.scheduler.renderer.lanes
    return {name: {"solve": lane.graphs.eager_calls, "encoder": getattr(lane.graphs, "eager_encodes", None)}
            for name, lane in lanes.items() if lane.graphs is not None}


def first_chunk_split(pipeline, voice: str, tokens: int) -> dict:
    from tts_core.runtime import CollectingSink, JobOptions

    sink = CollectingSink()
    job = pipeline.synthesize("Thank you for calling, please hold.", voice, sink,
                              JobOptions(min_tokens=tokens, max_tokens=tokens), call_id="split")
    sink.wait(600)
    first = job.timings.since_submit(job.timings.first_chunk)
    split = first_chunk_parts(job)
    split["other"] = first - sum(split.values())
    return {"first_chunk_ms": first * 1e3, **{f"{k}_ms": v * 1e3 for k, v in split.items()}}


def first_chunk_parts(job) -> dict[str, float]:
    """Seconds of a finished job's first chunk spent in each part of the pipeline."""
    t, c = job.timings, job.timings.chunks[0]
    return {"frontend": t.frontend_s, "prefill": t.prefill_s, "decode": c.lm_s, "flow": c.flow_s,
            "hift": c.hift_s, "handoff": c.handoff_s}


def first_chunk_stream_times(job) -> dict[str, float]:
    """Of a job's first chunk's "flow": the encoder's and the solve's seconds on the lane's CUDA
    stream, where the call was timed (graphed flows); of its "hift": the vocoder call's launch on
    the host and its seconds on the stream, where timed. Empty where neither was."""
    chunk = job.timings.chunks[0]
    times = {}
    if chunk.flow_gpu_s is not None:
        times.update(zip(("flow_encoder_gpu", "flow_solve_gpu"), chunk.flow_gpu_s))
    if chunk.hift_gpu_s is not None:
        times.update(zip(("hift_launch", "hift_gpu"), chunk.hift_gpu_s))
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", help="default: full-size random weights built into /tmp (CosyVoice2 or, with "
                   "--family 3, CosyVoice3); a given directory's family is read from it")
    p.add_argument("--family", type=int, choices=(2, 3), default=2, help="the full-size model to build without "
                   "--model-dir: 2 or 3 (bench/full_model.py --family)")
    p.add_argument("--golden", type=Path, default=None,
                   help="default ../shared/golden (family 2) or ../shared/golden_cv3 (family 3)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default=None, help="default bfloat16 on CUDA")
    p.add_argument("--rates", type=float, nargs="+", default=[1, 5, 10, 15, 20, 25])
    p.add_argument("--duration", type=float, default=15.0, help="seconds of arrivals per rate")
    p.add_argument("--settle-s", type=float, default=0.0,
                   help="judge pass/fail on requests arriving after this many seconds of a rate, and count "
                        "calls playing over that window only (0: every request, the ramp included)")
    p.add_argument("--min-tokens", type=int, default=80)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--max-batch", type=int, default=128)
    p.add_argument("--max-len", type=int, default=768)
    p.add_argument("--encoder-tokens", type=int, default=50, help="flow encoder window (0: every token, exact)")
    p.add_argument("--context-frames", type=int, default=650, help="own mel frames a stream keeps exactly")
    p.add_argument("--first-hop", type=int, default=None, help="first_hop_tokens (default: official)")
    p.add_argument("--flow-batches", type=int, nargs="+", default=None,
                   help="graph buckets (rows) of the later lane's batched flow call (default: the scheduler's)")
    p.add_argument("--graphs", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--defer-slack-s", type=float, nargs="+", default=[0.8],
                   help="later chunks wait while their stream has more unplayed audio than this (s); "
                        "several values: everything runs at each")
    p.add_argument("--one-stream", action="store_true", help="decode and render on the default CUDA stream")
    p.add_argument("--first-lanes", type=int, default=None,
                   help="first-chunk render lanes (0: one render thread; default: the scheduler's)")
    p.add_argument("--compile-flow", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the captured flow solves' estimator (default: the scheduler's)")
    p.add_argument("--compile-hift", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the captured HiFT graphs' upsampling stages (default: the scheduler's)")
    p.add_argument("--slot-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="decode steps attend from the KV cache by slot, a Triton kernel (default: the scheduler's)")
    p.add_argument("--llm-fp8", action="store_true", help="FP8 LM decoder-layer weights (tts_core/accel/fp8_linear.py)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, nargs="+", default=[0],
                   help="torch CPU threads (0: torch's default); several: everything runs at each")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for stragglers per rate")
    p.add_argument("--one-stream-requests", type=int, default=30,
                   help="requests sent one at a time for the 1-stream first-chunk p50 (0: skip)")
    p.add_argument("--switch-interval-ms", type=float, nargs="+", default=None,
                   help="GIL switch intervals to run every rate at (default: the scheduler's 1 ms)")
    p.add_argument("--first-chunk-hold-ms", type=float, nargs="+", default=None,
                   help="first_chunk_hold_s values (ms) to run everything at (default: the scheduler's)")
    p.add_argument("--yield-lead-s", type=float, nargs="+", default=None,
                   help="yield_lead_s values to run everything at (0: streams far ahead never yield; default: the "
                        "scheduler's)")
    p.add_argument("--steps-ahead", type=int, nargs="+", default=None,
                   help="carried decoder: decode steps launched and not yet read when an iteration ends "
                        "(decode_steps_ahead: 0 reads each at once); several: everything runs at each "
                        "(default: the scheduler's)")
    p.add_argument("--profile-rate", type=float, default=None,
                   help="record the GPU's kernels per CUDA stream (bench/gpu_trace.py) for --profile-s seconds "
                        "of this rate (its first variant; from --settle-s, else mid-run), and over one lone "
                        "request; the profiled rate's latencies carry the profiler's overhead")
    p.add_argument("--profile-s", type=float, default=2.0)
    p.add_argument("--host-waits", action="store_true",
                   help="time where the host threads wait as they launch GPU work (bench/host_waits.py), per rate")
    p.add_argument("--solve-parts", type=int, default=None, help="graphs per captured flow solve (default: the scheduler's)")
    p.add_argument("--parts-ahead", type=int, nargs="+", default=None,
                   help="variants: a solve's parts launched ahead of the GPU (default: the graphs' own)")
    p.add_argument("--paced-later", type=int, nargs="+", choices=(0, 1), default=[0],
                   help="with --host-waits, variants: 1 makes the later lane drain its stream around each graph "
                        "replay (a diagnostic, bench/host_waits.py)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/load_<date>.json)")
    args = p.parse_args(argv)
    default_threads = torch.get_num_threads()
    if args.threads[0]:
        torch.set_num_threads(args.threads[0])
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(max(args.switch_interval_ms) / 1e3)  # the scheduler only ever lowers it
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    graphs = args.graphs == "on" or (args.graphs == "auto" and cuda)

    from tts_core.runtime import CosyVoice2Pipeline, SchedulerSettings
    from tts_core.streaming.chunk_schedule import ChunkSchedule

    model_dir = Path(args.model_dir) if args.model_dir else None
    if model_dir is None:
        from full_model import full_model_dir

        model_dir = full_model_dir(golden=args.golden, family=args.family)
    if args.compile_flow is None:
        args.compile_flow = SchedulerSettings.compile_flow
    if args.compile_hift is None:
        args.compile_hift = SchedulerSettings.compile_hift
    if args.slot_attention is None:
        args.slot_attention = SchedulerSettings.slot_attention
    if args.first_lanes is None:
        args.first_lanes = SchedulerSettings.first_chunk_lanes
    if args.solve_parts is None:
        args.solve_parts = SchedulerSettings.flow_solve_parts
    fast = SchedulerSettings(flow_encoder_tokens=args.encoder_tokens or None, graphs=graphs,
                             flow_context_frames=args.context_frames,
                             defer_slack_s=args.defer_slack_s[0], separate_streams=not args.one_stream,
                             first_chunk_lanes=args.first_lanes,
                             compile_flow=args.compile_flow, compile_hift=args.compile_hift,
                             slot_attention=args.slot_attention,
                             flow_solve_parts=args.solve_parts,
                             flow_batches=tuple(args.flow_batches or SchedulerSettings.flow_batches))
    t0 = time.perf_counter()
    pipeline = CosyVoice2Pipeline.load(model_dir, args.device, resolve_dtype(dtype), max_batch=args.max_batch,
                                       max_len=args.max_len, schedule=ChunkSchedule(first_hop_tokens=args.first_hop),
                                       fast=fast, normalize=False, llm_fp8=args.llm_fp8)
    pipeline.scheduler.wait_compiled()  # ready on eager-module graphs; time the compiled ones
    load_s = time.perf_counter() - t0
    pipeline.scheduler.on_step = STEPS.append
    waits = HostWaits() if args.host_waits else None
    if waits is not None:
        waits.install()
    report: dict = {"device": torch.cuda.get_device_name() if cuda else platform.processor(), "dtype": dtype,
                    "family": pipeline.family.version,
                    "llm_fp8": args.llm_fp8, "compile_flow": args.compile_flow and graphs,
                    "compile_hift": args.compile_hift and graphs,
                    "slot_attention": pipeline.scheduler.decoder.slot_attention if graphs else False,
                    "torch": torch.__version__, "graphs": graphs, "encoder_tokens": args.encoder_tokens,
                    "context_frames": args.context_frames,
                    "separate_streams": not args.one_stream, "first_chunk_lanes": args.first_lanes,
                    "solve_parts": args.solve_parts,
                    "first_hop_tokens": args.first_hop, "max_batch": args.max_batch,
                    "flow_batches": list(fast.flow_batches),
                    "tokens_bounds": [args.min_tokens, args.max_tokens], "duration_s": args.duration,
                    "settle_s": args.settle_s, "load_s": load_s,
                    "capture": pipeline.scheduler.capture_report}
    try:
        names = pipeline.voices.names()
        voice = "bench_voice" if "bench_voice" in names else names[0]
        report["warmup_s"] = pipeline.warmup(voice)
        report["first_chunk_split_1_stream"] = first_chunk_split(pipeline, voice, args.min_tokens)
        if args.profile_rate is not None:
            report["gpu_trace_alone"] = gpu_trace.summary(gpu_trace.record(
                lambda: one_stream(pipeline, voice, 1, random.Random(args.seed), args.min_tokens, args.max_tokens)))
            print("GPU trace, one lone request:", json.dumps(_trace_brief(report["gpu_trace_alone"])), flush=True)
        report["rates"], report["one_stream"] = [], []
        out = args.out or REPO / "bench" / "results" / f"load_{datetime.date.today().isoformat()}.json"
        intervals = args.switch_interval_ms or [sys.getswitchinterval() * 1e3]
        holds = args.first_chunk_hold_ms or [pipeline.scheduler.settings.first_chunk_hold_s * 1e3]
        aheads = args.steps_ahead if args.steps_ahead is not None else \
            [pipeline.scheduler.settings.decode_steps_ahead]
        if any(args.paced_later) and waits is None:
            p.error("--paced-later needs --host-waits")
        if args.parts_ahead and min(args.parts_ahead) < 1:
            p.error("--parts-ahead: at least 1 (the part being launched)")
        # CosyVoice2's solves launch in parts (`parts_ahead`); CosyVoice3's DiT solve is one graph.
        flow_graphs = [lane.graphs for lane in pipeline.scheduler.renderer.lanes.values()
                       if hasattr(lane.graphs, "parts_ahead")]
        parts_ahead = args.parts_ahead or sorted({g.parts_ahead for g in flow_graphs}) or [0]
        leads = args.yield_lead_s or [pipeline.scheduler.settings.yield_lead_s]
        variants = [(d, h, i, a, n, pl, pa, y) for y in leads for d in args.defer_slack_s for h in holds
                    for i in intervals for a in aheads for n in args.threads for pl in args.paced_later
                    for pa in parts_ahead]
        for (slack, hold, interval, ahead, threads, paced, part_ahead, lead), rate in \
                [(v, r) for v in variants for r in [None, *args.rates]]:
            torch.set_num_threads(threads or default_threads)
            for g in flow_graphs:
                g.parts_ahead = part_ahead
            if waits is not None:
                waits.paced_threads = frozenset({"tts-render-later"} if paced else ())
            # The scheduler and its render lanes read these each round: variants share one start-up.
            pipeline.scheduler.settings = dataclasses.replace(pipeline.scheduler.settings, decode_steps_ahead=ahead,
                                                              first_chunk_hold_s=hold / 1e3, defer_slack_s=slack,
                                                              yield_lead_s=lead)
            for lane in pipeline.scheduler.render_lanes:
                lane.defer_slack_s = slack
            sys.setswitchinterval(interval / 1e3)
            if rate is None:
                if args.one_stream_requests:
                    one = one_stream(pipeline, voice, args.one_stream_requests, random.Random(args.seed),
                                     args.min_tokens, args.max_tokens)
                    one.update(first_chunk_hold_ms=hold, switch_interval_ms=interval, defer_slack_s=slack,
                               decode_steps_ahead=ahead, yield_lead_s=lead,
                               torch_threads=torch.get_num_threads(), parts_ahead=part_ahead)
                    report["one_stream"].append(one)
                    print("1 stream, one request at a time:", json.dumps(one), flush=True)
                continue
            STEPS.clear()
            # If a rate never finishes, every thread's stack says where it hangs.
            faulthandler.dump_traceback_later(args.duration + 25, exit=False)
            pipeline.scheduler.renders.clear()
            # Seeded per rate: every variant sees the same arrivals and texts.
            rng = random.Random(f"{args.seed}-{rate}")
            profile = None
            if rate == args.profile_rate and not any("gpu_trace" in done for done in report["rates"]):
                profile = (args.settle_s or args.duration / 2, args.profile_s)
            if waits is not None:
                waits.take()  # from this rate's start
            r = run_rate(pipeline, voice, rate, args.duration, rng, args.min_tokens, args.max_tokens, args.timeout,
                         args.settle_s, profile)
            faulthandler.cancel_dump_traceback_later()
            if waits is not None:
                r["host_waits"] = waits.take()
            # Underruns count from every request (one in the ramp is still a gap a caller heard).
            judged = r["steady"] if args.settle_s > 0 else r
            r["passes"] = r["failed"] == 0 and r["underruns"] == 0 and judged["first_chunk_ms"][95] <= 300.0
            r["switch_interval_ms"], r["first_chunk_hold_ms"], r["defer_slack_s"] = interval, hold, slack
            r["decode_steps_ahead"] = ahead
            r["yield_lead_s"] = lead
            r["torch_threads"] = torch.get_num_threads()
            r["paced_later"] = bool(paced)
            r["parts_ahead"] = part_ahead
            report["rates"].append(r)
            _print_row(r)
            if args.settle_s > 0:
                print("  steady:", json.dumps(r["steady"]), flush=True)
            if "gpu_trace" in r:
                print("  GPU trace:", json.dumps(_trace_brief(r["gpu_trace"])), flush=True)
            if "host_waits" in r:
                print("  host waits:", json.dumps(r["host_waits"]), flush=True)
            print("  first chunk stages:", json.dumps(r["first_chunk_split"]), "\n  first chunk render:",
                  json.dumps(r["first_chunk_render"]), "\n  decode thread:", json.dumps(r["decode_thread"]), flush=True)
            write_partial(out, report)  # a run cut short by a time limit keeps the rates it finished
    finally:
        pipeline.close()
    # Concurrency as a call center counts it: calls hearing audio at once (`playing`), over every
    # variant run; a call still synthesising (`mean`) depends on how long later chunks are deferred.
    passing = [r for r in report["rates"] if r["passes"]]
    best = max(passing, key=lambda r: r["steady"]["playing_mean"] if args.settle_s > 0 else r["playing_mean"],
               default=None)
    report["max_concurrency_passing"] = (
        {"rate_per_s": best["rate_per_s"], "mean": best["concurrency_mean"], "peak": best["concurrency_peak"],
         "playing_mean": best["playing_mean"], "playing_peak": best["playing_peak"],
         "steady_playing_mean": best["steady"]["playing_mean"], "steady_playing_peak": best["steady"]["playing_peak"],
         **{k: best[k] for k in ("defer_slack_s", "first_chunk_hold_ms", "switch_interval_ms", "decode_steps_ahead",
                                   "yield_lead_s")}}
        if best else None)
    _print(report)
    write_partial(out, report)
    print(f"wrote {out}")
    return 0


def write_partial(out: Path, report: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


HEADER = f"{'rate/s':>6} {'reqs':>5} {'fail':>4} {'conc':>6} {'peak':>5} {'play':>6} {'peak':>5} {'p50ms':>7} " \
         f"{'p95ms':>7} {'p99ms':>7} {'underr':>6} {'rtf':>6} {'memGB':>6} pass"


def _trace_brief(trace: dict) -> dict:
    """Per stream: kernels, ms of kernels, busy, overlapped by other streams, short and long gaps, and
    the kernels most often found after a long gap."""
    return {"span_ms": round(trace["span_ms"], 1), "device_events": trace.get("device_events"),
            **{stream: {**{k: round(v, 2) if isinstance(v, float) else v for k, v in st.items()
                           if k not in ("top", "after_long_gap")},
                        "after_long_gap": dict(list(st.get("after_long_gap", {}).items())[:3])}
               for stream, st in trace["streams"].items()}}


def _print_row(r: dict) -> None:
    f = r["first_chunk_ms"]
    mem = f"{r['gpu_mem_gb']:.1f}" if r["gpu_mem_gb"] is not None else "-"
    rtf = f"{r['rtf_mean']:.3f}" if r["rtf_mean"] is not None else "-"
    lanes = "; ".join(f"{lane} busy {100 * x['busy_fraction']:.0f} %, {x['ms_mean']:.1f} ms/call (flow "
                      f"{x['flow_ms_mean']:.1f}, hift {x['hift_ms_mean']:.1f}), {x['chunks_per_call']:.1f} chunks/call"
                      for lane, x in r["render"].items())
    print(f"{r['rate_per_s']:>6g} {r['requests']:>5} {r['failed']:>4} {r['concurrency_mean']:>6.1f} "
          f"{r['concurrency_peak']:>5} {r['playing_mean']:>6.1f} {r['playing_peak']:>5} {f[50]:>7.1f} {f[95]:>7.1f} "
          f"{f[99]:>7.1f} {r['underruns']:>6} {rtf:>6} {mem:>6} {r['passes']}  GIL {r.get('switch_interval_ms')} ms, "
          f"hold {r.get('first_chunk_hold_ms')} ms, defer slack {r.get('defer_slack_s')} s, "
          f"steps ahead {r.get('decode_steps_ahead')}, torch threads {r.get('torch_threads')}, "
          f"paced later {r.get('paced_later')}, parts ahead {r.get('parts_ahead')}, "
          f"step {r['step_ms_mean']:.1f} ms "
          f"(decode {r['decode_ms_mean'] or 0:.1f}; render {lanes})", flush=True)


def _print(report: dict) -> None:
    print(f"\n{report['device']} {report['dtype']}{' + fp8 LM' if report['llm_fp8'] else ''} graphs={report['graphs']} encoder_tokens={report['encoder_tokens']} "
          f"load {report['load_s']:.1f} s (capture {report['capture'].get('capture_s', 0):.1f} s) "
          f"warm-up {report['warmup_s']:.2f} s")
    s = report["first_chunk_split_1_stream"]
    print("1 stream first chunk: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in s.items()) + " (ms)")
    print(HEADER)
    for r in report["rates"]:
        _print_row(r)
    print(f"largest passing concurrency (p95 first chunk <= 300 ms, 0 underruns): {report['max_concurrency_passing']}")


if __name__ == "__main__":
    sys.exit(main())
