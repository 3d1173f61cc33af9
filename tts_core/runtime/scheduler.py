"""SynthesisScheduler: what runs next on the device, on two threads (nano-vllm's roles of scheduler
and model runner, which stay small enough here to share a file).

The decode thread (here) owns the LM and its KV cache; the render threads (`render_loop.RenderLoop`,
one for first chunks and one for later chunks, started and stopped by the scheduler) own flow +
HiFT. Split so that LM decoding never waits for chunk rendering: a batched later-chunk flow call
costs 5-60 ms on a GPU and, on one thread, stalled every stream's decode step (docs/PERF_NOTES.md);
and so that a new call's first chunk never waits for a later-chunk call. On CUDA each thread issues
its work on its own stream, decode on the highest priority and later chunks on the lowest; only host
ints (`job.tokens`) pass between them, so no device event crosses. Other threads only `submit` jobs and cancel them through their sinks.

One decode iteration:
1. drop cancelled jobs (their KV slot is free at once); retire the jobs whose last chunk the render
   thread handed out; admit waiting jobs while slots are free; one batched prefill for every job
   that starts a segment (new jobs, and jobs whose previous segment is fully rendered);
2. sample one token per job from the step's logp (copied to the host once per step), and append
   the tokens under the lock, waking the render thread when a chunk may be due;
3. one batched `decode_step` over all generating jobs (continuous batching: jobs join and leave
   at any step; each sits at its own position in its own cache row).
With a carried decoder (the default with graphs; tts_core/accel/carried_decode.py) steps 2-3 draw
on the device and each row's next input stays there: the iteration launches step k+1, then reads
step k's tokens (`decode_steps_ahead`), so the GPU does not wait for the host between steps. A
segment's prefill and first draw run on a CUDA stream of their own; the job joins the steps once
the host sees its first token (no step of the other jobs waits for a prefill).

All shared state (the job lists, slots, the hand-over flags of `request.SynthesisJob`) is guarded
by one lock, under which both threads' conditions wait; neither thread polls. A failure inside
one job (prefill, sampling, rendering, its sink) fails that job's sink only, from either thread.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import structlog
import torch

from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.accel.carried_decode import EagerCarriedDecoder, PendingTokens
from tts_core.accel.lm_graphs import HOST_BUFFERS
from tts_core.flow import FlowModel
from tts_core.hift import HiftGenerator
from tts_core.llm.sampling import RasSampler
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.runtime.chunk_render import ChunkRenderer, FlowPoolSettings
from tts_core.runtime.render_loop import RenderLoop, RenderTiming, device_stream
from tts_core.runtime.request import SynthesisError, SynthesisJob
from tts_core.streaming.chunk_schedule import ChunkSchedule
from tts_core.voices import Voice

log = structlog.get_logger(__name__)

# The most decode steps left unread: the graphed carried decoder rotates HOST_BUFFERS pinned
# buffers, and the step being launched needs one besides those of the unread steps.
MAX_STEPS_AHEAD = HOST_BUFFERS - 1
GIL_SWITCH_INTERVAL_S = 0.001  # as the gateway's packet clock sets it (gateway/app.py)
FIRST_TOKEN_POLL_S = 0.0005  # how often an idle decode thread looks for a prefill's first token

TextFrontend = Callable[[str], list[list[int]]]  # text -> text tokens per segment


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = 8
    max_len: int = 2048  # KV-cache positions per slot: prompt text + text + prompt speech + generated
    schedule: ChunkSchedule = ChunkSchedule()
    # The flow (tts_core.runtime.chunk_render, tts_core.flow.pooled): every frame once, batched across
    # streams; exact up to `flow_context_frames` of a segment's own speech, then its latest frames.
    flow_context_frames: int = 700
    flow_encoder_tokens: int | None = None  # None: the encoder reads every token (exact); N: a window
    flow_voice_slots: int = 8  # voices whose shared prompt frames the flow pool holds
    graphs: bool = False  # CUDA only: captured decode (+ on-device sampling), prefill, flow and HiFT
    prefill_buckets: tuple[int, ...] = (128, 192, 256, 320, 384, 512)
    attend_buckets: tuple[int, ...] = (256, 512, 1024, 2048)
    # Graph buckets of the batched flow call; the largest is the most chunks per call, which also
    # bounds how long a new call's first chunk can wait behind a call in progress (~0.3 s at 32).
    flow_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # First chunks render on lanes (threads, CUDA streams, graphs) of their own, beside the later
    # chunks' large calls (render_loop); their graph buckets. 0: one render thread does both.
    # H100, 30 s of arrivals judged after 10 s: with 2 lanes a first chunk waited up to 46-72 ms
    # (p95) for a lane at 12-14 req/s, with 3 0.8-12 ms. p95 first chunk at 12 req/s: 327-334 ms
    # with 2 lanes, 285 and 300.2 with 3 (13 req/s: 278), 292 with 4; 4 were no better than 3 at
    # 14-15 req/s (bench/results/load_2026-11-23_h100_{prefill_stream,three_first_lanes,
    # four_first_lanes,head_024200e}.json).
    first_chunk_lanes: int = 3
    flow_first_batches: tuple[int, ...] = (1, 2, 4, 8)
    # The captured flow solves run torch.compile'd resnets and transformer blocks (fewer, fused
    # kernels; compiled at start-up, one compiled block for all 56). Only with `graphs`. H100,
    # load_2026-11-23_h100_compile_flow_fixed*.json: a first chunk's solve 35 ms on the GPU against
    # 43-45 eager, one stream p50 90 ms against 97-99; under load (10 s of arrivals) 14 req/s passes
    # (p95 253-262 ms, 30 calls playing) where eager passed 8-11. It costs start-up: the flow
    # capture takes 73-109 s with a warm compiler cache and ~150 s cold, against 50-60 s eager.
    compile_flow: bool = True
    # The captured HiFT graphs run torch.compile'd upsampling stages (accel/hift_graphs.compiled_mix:
    # a Snake and the add before it in one kernel; ~450 kernels a chunk against ~1150). Only with
    # `graphs`. H100, fp32, bench/results/hift_2026-11-24_h100.json: a first chunk 2.07 ms on the
    # GPU against 3.33, a later chunk of 8 streams 7.6 against 12.8, of 32 streams 26 against 49;
    # 56-80 dB SNR against the plain graphs at one row, and at two in some runs (cuDNN picks
    # other algorithms there), bit-equal otherwise. Compiling takes ~60 s of start-up with a cold
    # compiler cache.
    compile_hift: bool = True
    # Captured decode steps rotate q/k, write the step's keys/values and attend from the KV cache by
    # slot, each row over its own columns, in one Triton kernel per layer (accel/decode_attention.py),
    # instead of rotary and cache-write kernels and a gather of every row's `attend` columns for SDPA.
    # Only with `graphs` and Triton. H100, bf16, compiled step, gathered -> this kernel
    # (bench/results/decode_2026-11-24_h100_rotary_write_fused.json): 1.15 -> 0.99 ms at 1 call,
    # 1.24 -> 1.01 at 16, 1.61 -> 1.11 at 64.
    slot_attention: bool = True
    # Graphs per captured flow solve, cut at Euler-step boundaries and launched two ahead of the
    # GPU (accel/flow_pool_graphs.PooledFlowGraphs.capture). H100, 30 s of arrivals judged after
    # 10 s: a whole solve's launch held its lane's thread for 10-55 ms on average (up to 127), and
    # the decode thread stalled 4.8-5.2 s a run in its CUDA calls meanwhile; cut into 10, launches
    # take under 1 ms at p95 and the decode thread stalls 25-69 ms a run. Steady p95 first chunk
    # at 19 req/s 318.9-329.4 -> 276.4 and 287.6 ms, at 20 req/s 355.9 -> 279.3-294.9, 21 req/s
    # 275.8 and 286.2 (107 calls playing) (bench/results/load_2026-11-24_h100_{paced_later,
    # launch_kinds,solve_parts*}.json). 1: one graph per solve.
    flow_solve_parts: int = 10
    # A later chunk whose stream still has more than this much unplayed audio waits, so
    # that chunks of many streams gather into one batched flow call instead of many small ones
    # (first chunks never wait).
    defer_slack_s: float = 0.8
    # Decode and render threads on two CUDA streams (decode at the highest priority), so a decode
    # step never queues behind a flow call. False: both issue on the default stream (host work still
    # overlaps). H100, bench/results/load_2026-11-23_h100_pooled_*: at 14 req/s two streams kept
    # p95 first chunk 1.8 s / 2 underruns where one stream gave 3.2 s / 185.
    separate_streams: bool = True
    # While every generating job has drawn its first chunk's tokens and waits for that chunk, the
    # decode thread pauses, for at most this long per job (0: never): its steps would run beside
    # those first chunks' renders and slow them (`SynthesisJob.held_for_first_chunk`). Once any job
    # needs a step, all decode: the step costs about the same with a few more rows, and a held row
    # would only fall behind. H100, bench/results/load_2026-11-23_h100_hold_all_or_none.json: one
    # stream's first chunk p50 99.7 ms held, 115.8 ms not (its flow solve 43 ms instead of 58 on the
    # GPU); under load (11-17 req/s) p95 within -9..+7 % of not holding, 0 underruns either way.
    first_chunk_hold_s: float = 0.3
    # Carried: steps launched and not yet read when an iteration ends. 0: each step is read at once;
    # 1: launch step k+1, then read step k; 2: launch k+2, then read k, so a host iteration that
    # runs late (the GIL shared with the render threads) still finds a step queued on the GPU. A
    # row steps up to this many times more after the step that draws its stop token (thrown away;
    # steps in flight count against its token limit, so they stay inside its cache row). Read
    # every iteration (benchmarks compare values on one start-up). H100, p95 first chunk with 1
    # against 2 on one start-up: 16 req/s 243.9 / 253.7 ms, 17 293.0 / 293.1, 18 263.8 / 275.6
    # (bench/results/load_2026-11-24_h100_steps_ahead_16_18.json); two earlier start-ups had 2
    # ~30 ms better at 17 req/s only. Within the noise: 1 stays.
    decode_steps_ahead: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.decode_steps_ahead <= MAX_STEPS_AHEAD:
            raise ValueError(f"SchedulerSettings: decode_steps_ahead must be 0..{MAX_STEPS_AHEAD}, "
                             f"got {self.decode_steps_ahead}")


@dataclass(frozen=True)
class StepTiming:
    """One decode-thread iteration (render calls are `render_loop.RenderTiming`s)."""

    batch: int  # jobs in the decode step
    prefills: int
    prefill_s: float
    decode_s: float
    sample_s: float
    wall_s: float  # the whole iteration (admission and frontend included)
    wait_s: float = 0.0  # of decode_s: waiting for a step's tokens (carried decoder)
    first_wait_s: float = 0.0  # after decode_s, nothing to step: waiting for a prefill's first token


class SynthesisScheduler:
    def __init__(self, lm: SpeechTokenLM, sampler: RasSampler, flow: FlowModel, hift: HiftGenerator,
                 frontend: TextFrontend, settings: SchedulerSettings = SchedulerSettings()) -> None:
        self.lm, self.sampler, self.flow, self.hift = lm, sampler, flow, hift
        self.frontend = frontend
        self.settings = settings
        # With graphs one extra cache row is the decode graphs' scratch slot, never a job's.
        self.cache = lm.setup_cache(settings.max_batch + (1 if settings.graphs else 0), settings.max_len)
        self.renderer = ChunkRenderer(flow, hift, FlowPoolSettings(
            stream_slots=settings.max_batch, context_frames=settings.flow_context_frames,
            encoder_tokens=settings.flow_encoder_tokens, batches=settings.flow_batches,
            voice_slots=settings.flow_voice_slots, first_batches=settings.flow_first_batches,
            first_lanes=settings.first_chunk_lanes, compile=settings.compile_flow, compile_hift=settings.compile_hift,
            solve_parts=settings.flow_solve_parts))
        self.decoder = None  # GraphedDecoder, once captured (or an EagerCarriedDecoder)
        # The carried decoder's steps in flight, oldest first: tokens, the (job, segment) of each
        # row, and the rows' slots (a row's job may have released its slot since).
        self._pending: deque[tuple[PendingTokens, list[tuple[SynthesisJob, int]], list[int]]] = deque()
        self._seeded: dict[int, tuple[SynthesisJob, int]] = {}  # slot -> the segment its carried state is
        self._last_wait_s = 0.0
        # Carried: jobs whose prefill and first draw are launched, with their first token on its way.
        self._prefilling: list[tuple[SynthesisJob, int, PendingTokens]] = []
        if not settings.graphs:
            self.decoder = EagerCarriedDecoder(lm, BatchedRasSampler(sampler.config, lm.speech_token_size))
        self.prefiller = None  # GraphedPrefill, once captured
        self.capture_report: dict = {}
        # Re-entrant: a job failed by the render thread while it holds the lock releases under it too.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the decode thread waits on it
        self._waiting: deque[SynthesisJob] = deque()
        self._active: list[SynthesisJob] = []  # admitted and not yet released; shared with the render loop
        self._free_slots = list(range(settings.max_batch))
        self._stopping = False
        self._thread: threading.Thread | None = None
        # Decode at the device's highest stream priority, first chunks next, later chunks lowest: when
        # several streams have kernels queued, the one a listener is waiting on goes first.
        high = min(torch.cuda.Stream.priority_range()) if self.cache.device.type == "cuda" else 0
        self._decode_priority = high
        # Carried, on CUDA with separate streams: prefills and first draws run here. It waits for the
        # default stream when the decode thread starts, and for the decode stream only before a
        # prefill into a slot that a step in flight still uses (`_launch_prefills`).
        self._prefill_stream = (torch.cuda.Stream(self.cache.device, priority=high)
                                if self.cache.device.type == "cuda" and settings.separate_streams else None)
        renders: deque[RenderTiming] = deque(maxlen=10_000)
        wake = threading.Condition(self._lock)
        lanes = [("first", name, high // 2) for name in self.renderer.first_lanes]
        lanes.append(("later", "later", 0) if lanes else ("all", "later", 0))
        self.render_lanes = [RenderLoop(self._lock, self._active, self._cond, self._fail, self.renderer,
                                        settings.schedule, settings.defer_slack_s, settings.separate_streams,
                                        lane=kind, priority=priority, renders=renders, wake=wake, replays=name)
                             for kind, name, priority in lanes]
        self._renders = renders
        self.steps: deque[StepTiming] = deque(maxlen=10_000)

    @property
    def renders(self) -> deque[RenderTiming]:
        return self._renders

    # ---- any thread ------------------------------------------------------------------------------
    def capture(self, voices: Sequence[Voice]) -> dict:
        """Capture every CUDA graph the loops will replay (before `start`; seconds, once per process),
        so no request pays for it. Returns what was captured and how long each part took. Registers
        the voices with the flow (their shared prompt frames) with or without graphs."""
        s = self.settings
        report = self.renderer.prepare(voices, s.schedule, s.graphs)
        if not s.graphs:
            self.capture_report = report
            return report
        from tts_core.accel.buckets import power_of_two_buckets
        from tts_core.accel.lm_graphs import GraphedDecoder, GraphedPrefill

        t0 = time.perf_counter()
        attend = tuple(b for b in s.attend_buckets if b < s.max_len) + (s.max_len,)
        self.decoder = GraphedDecoder(self.lm, BatchedRasSampler(self.sampler.config, self.lm.speech_token_size),
                                      power_of_two_buckets(s.max_batch), attend, scratch_slot=s.max_batch,
                                      slot_attention=s.slot_attention)
        report["decode_capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.prefiller = GraphedPrefill(self.lm, tuple(b for b in s.prefill_buckets if b <= s.max_len))
        report["prefill_capture_s"] = time.perf_counter() - t0
        torch.cuda.synchronize()
        report["capture_s"] = sum(v for k, v in report.items() if k.endswith("_capture_s"))
        self.capture_report = report
        log.info("tts_graphs_captured", **{k: v for k, v in report.items() if k.endswith("_s")})
        return report

    def start(self) -> None:
        if self._thread is not None:
            return
        if sys.getswitchinterval() > GIL_SWITCH_INTERVAL_S:
            # The decode thread comes back from each step's device sync needing the GIL while the
            # render threads run Python (planning, tables, vocoder glue); at CPython's default 5 ms
            # it can wait that long every step, and a first chunk takes ~28 steps.
            sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
            log.info("tts_gil_switch_interval_set", seconds=GIL_SWITCH_INTERVAL_S)
        for lane in self.render_lanes:
            lane.start()
        self._thread = threading.Thread(target=self._run, name="tts-decode", daemon=True)
        self._thread.start()

    def submit(self, job: SynthesisJob) -> None:
        with self._cond:
            if self._stopping:
                raise SynthesisError("synthesis scheduler is stopped")
            job.timings.queued = time.perf_counter()
            self._waiting.append(job)
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop both threads; jobs still waiting or running fail with SynthesisError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        for lane in self.render_lanes:
            lane.stop(timeout)
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cond:
            left = list(self._waiting) + self._active
            self._waiting.clear()
            self._active.clear()
        for job in left:
            job.sink.fail(SynthesisError("synthesis stopped"))

    @property
    def active_jobs(self) -> int:
        with self._cond:
            return len(self._active)

    @property
    def free_slots(self) -> int:
        with self._cond:
            return len(self._free_slots)

    def _wake_render(self) -> None:
        self.render_lanes[0].wake()  # one condition for all lanes: wakes them all

    # ---- the decode thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local
        with device_stream(self.cache.device, priority=self._decode_priority, separate=self.settings.separate_streams):
            if self._prefill_stream is not None:  # prefills come after everything before this thread
                self._prefill_stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            while True:
                with self._cond:
                    while not self._stopping and not self._has_work():
                        self._cond.wait(self._hold_ends())
                    if self._stopping:
                        return
                try:
                    self._step()
                except Exception as exc:  # a bug outside any one job: fail what is running, keep serving
                    log.exception("tts_scheduler_step_failed")
                    for job in self._jobs():
                        self._fail(job, exc)

    def _has_work(self) -> bool:
        """Under the lock. Jobs whose LM finished wait for the render thread, which wakes us; so do
        jobs held for their first chunk (or the hold's end, `_hold_ends`)."""
        return bool(self._pending or self._prefilling) or self._has_new_work()  # or carried tokens to read

    def _has_new_work(self) -> bool:
        """Under the lock: work besides reading tokens already on their way to the host."""
        if self._waiting and self._free_slots:
            return True
        if any(job.cancelled or job.segment_rendered for job in self._active):
            return True
        return any(job.generating for job in self._active) and self._hold_ends() is None

    def _hold_ends(self) -> float | None:
        """Under the lock: seconds until the decode hold ends (None: not held). Held while every
        generating job is held for its first chunk; it ends when the first of their holds does."""
        hold = self.settings.first_chunk_hold_s
        if not hold:
            return None
        now = time.perf_counter()
        left = [job.held_for_first_chunk(now, hold) for job in self._active if job.generating]
        return min(left) if left and min(left) > 0 else None

    def _jobs(self) -> list[SynthesisJob]:
        """A snapshot of the active jobs: the render thread may release one while we iterate."""
        with self._cond:
            return list(self._active)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._drop_cancelled()
        starting = self._retire_rendered() + self._admit()
        prefilled = self._launch_prefills(starting) if starting else 0
        if self._prefilling:
            self._take_first_tokens()
        t1 = t2 = time.perf_counter()
        self._last_wait_s = 0.0
        batch = self._decode()
        t3 = time.perf_counter()
        idle = bool(self._prefilling) and not batch and not self._pending
        if idle:
            self._await_first_token()  # nothing else to do: wait for a first token, or other work
        t4 = time.perf_counter()
        if batch or prefilled or idle:
            self.steps.append(StepTiming(batch, prefilled, t1 - t0, t3 - t2, t2 - t1, t4 - t0, self._last_wait_s,
                                         t4 - t3))

    def _drop_cancelled(self) -> None:
        for job in self._jobs():
            if job.cancelled and self._release(job):
                log.info("tts_job_cancelled", call_id=job.call_id, audio_s=round(job.audio_s, 3))

    def _retire_rendered(self) -> list[SynthesisJob]:
        """Jobs whose segment the render thread finished: retire those with nothing left to say;
        return the others, whose next segment starts now."""
        with self._cond:
            rendered = [job for job in self._active if job.segment_rendered]
            done = [job for job in rendered if not job.has_next_segment]
            for job in done:
                job.timings.finished = time.perf_counter()
                job.done = True
                self._release(job)  # before the sink hears the end, so a finished stream's slot is free
        for job in done:
            job.sink.finish()
            log.info("tts_job_done", call_id=job.call_id, audio_s=round(job.audio_s, 3),
                     segments=len(job.segments), chunks=len(job.timings.chunks),
                     first_chunk_s=job.timings.since_submit(job.timings.first_chunk))
        return [job for job in rendered if job.has_next_segment]

    def _admit(self) -> list[SynthesisJob]:
        admitted = []
        with self._cond:
            while self._waiting and self._free_slots:
                job = self._waiting.popleft()
                if job.cancelled:
                    continue
                job.slot = self._free_slots.pop(0)
                self._active.append(job)
                admitted.append(job)
        for job in list(admitted):
            job.timings.admitted = time.perf_counter()
            try:
                job.segments = self.frontend(job.text)
            except Exception as exc:
                self._fail(job, exc)
                admitted.remove(job)
                continue
            job.timings.frontend_s = time.perf_counter() - job.timings.admitted
            if not job.segments:  # only punctuation: the official model returns a blip of silence
                log.info("tts_job_nothing_to_speak", call_id=job.call_id)
                self._release(job)
                job.sink.finish()
                admitted.remove(job)
        return admitted

    def _launch_prefills(self, jobs: list[SynthesisJob]) -> int:
        """Carried: each job's prefill and first draw, on the prefill stream (its LM input built
        there too); the first tokens are taken once they reach the host (`_take_first_tokens`)."""
        context = nullcontext()
        if self._prefill_stream is not None:
            # A slot may still be a row of a step in flight (freed by a hang-up, or the job's own
            # previous segment stepping on past its stop token): its cache row, length and carried
            # state. A prefill into it must come after those steps. Other slots' prefills need not
            # wait: a step writes only its own rows' slots. The steps never wait for a prefill.
            in_flight = {slot for _, _, slots in self._pending for slot in slots}
            if any(job.slot in in_flight for job in jobs):
                self._prefill_stream.wait_stream(torch.cuda.current_stream(self.cache.device))
            context = torch.cuda.stream(self._prefill_stream)
        launched = 0
        with context:
            for job in jobs:
                started = time.perf_counter()
                try:
                    _, slot, lm_input = self._start_segment(job)
                    if self.prefiller is not None and self.prefiller.fits(lm_input.shape[0]):
                        logp = self.prefiller.prefill(slot, lm_input)
                    else:
                        logp = self.lm.prefill([slot], [lm_input])
                    first = self.decoder.draw_first([slot], logp, [job.min_len <= 0])
                except Exception as exc:
                    self._fail(job, exc)
                    continue
                job.kv_len = lm_input.shape[0]
                job.timings.prefill_s += time.perf_counter() - started
                self._prefilling.append((job, job.segment, first))
                launched += 1
        return launched

    def _await_first_token(self) -> None:
        """Wait until a prefill's first token is on the host or there is other work (a new call to
        admit, whose prefill should not queue behind the others'; a segment to retire; the decode
        hold's end), then take what arrived. Polled: a CUDA event cannot be waited on together with
        the condition that `submit` and the render lanes notify."""
        firsts = [first for _, _, first in self._prefilling]
        with self._cond:
            while not any(first.ready() for first in firsts) and not self._has_new_work() and not self._stopping:
                self._cond.wait(FIRST_TOKEN_POLL_S)
        self._take_first_tokens()

    def _take_first_tokens(self) -> None:
        """Carried: accept the first tokens that reached the host; their jobs then join the next
        step, their slots' carried state already set on the device."""
        taken, left = [], []
        for job, segment, first in self._prefilling:
            if first.ready():
                token = self._wait_for(first)[0]
                if job.slot is not None and job.segment == segment:
                    self._seeded[job.slot] = (job, segment)
                    taken.append((job, token))
            else:
                left.append((job, segment, first))
        self._prefilling = left
        now = time.perf_counter()
        for job, _ in taken:
            if job.timings.prefill_done is None:
                job.timings.prefill_done = now
        self._accept(taken)

    def _start_segment(self, job: SynthesisJob) -> tuple[SynthesisJob, int, torch.Tensor]:
        """The next segment's LM input; hands the segment to the render thread, which sets up its
        rendering while the prefill runs. Returns (job, its slot, the prefill input)."""
        voice = job.voice
        text = job.segments[job.segment + 1]
        lm_input = self.lm.build_prefill_input(text, voice.prompt_text, voice.llm_prompt_speech_token)
        room = self.cache.max_len - lm_input.shape[0]
        if room < 1:
            raise SynthesisError(f"segment needs {lm_input.shape[0]} KV positions; the cache holds "
                                 f"{self.cache.max_len} (raise max_len or shorten the text)")
        min_len, max_len = self.lm.length_bounds(len(text))
        opts = job.options
        min_len = opts.min_tokens if opts.min_tokens is not None else min_len
        max_len = min(opts.max_tokens if opts.max_tokens is not None else max_len, room)
        with self._cond:
            # The slot is read here once: the render thread may fail (release) the job at any time.
            slot = job.slot
            if slot is None:
                raise SynthesisError("job was released before its segment started")
            job.start_segment(min(min_len, max_len), max(max_len, 1))
        self._wake_render()
        return job, slot, lm_input

    def _accept(self, drawn: Sequence[tuple[SynthesisJob, int]]) -> None:
        """Append the drawn tokens under the lock, so that the render thread reads each job's tokens
        and `lm_finished` as one snapshot; wake it if some job may now have a chunk due."""
        if not drawn:
            return
        wake = False
        with self._cond:
            for job, token in drawn:
                job.accept_token(token, self.lm.speech_token_size)
                wake = wake or job.lm_finished or len(job.tokens) >= job.wake_render_at
        if wake:
            self._wake_render()

    def _decode(self) -> int:
        """Launch a step for every generating job (unless held), then read the oldest steps until
        only `decode_steps_ahead` are unread (all of them when nothing was launched)."""
        pending = self._pending
        # id(job) -> its rows in the steps launched and not yet read
        in_flight = Counter(id(job) for _, rows, _ in pending for job, _ in rows)
        with self._cond:  # slots read once, under the lock (see _start_segment)
            held = self._hold_ends() is not None
            # A row whose steps in flight draw its last allowed token steps no further; a row whose
            # step in flight draws a stop token steps on until the host reads it (thrown away).
            batch = [] if held else [(job, job.slot) for job in self._active if job.generating
                                     and len(job.tokens) + in_flight[id(job)] < job.max_len]
        started = time.perf_counter()
        if batch:
            jobs, slots = [job for job, _ in batch], [slot for _, slot in batch]
            fresh = [(job, slot) for job, slot in batch if self._seeded.get(slot) != (job, job.segment)]
            if fresh:
                self.decoder.seed([slot for _, slot in fresh], [job.tokens for job, _ in fresh])
                for job, slot in fresh:
                    self._seeded[slot] = (job, job.segment)
            allow_stop = [len(job.tokens) + in_flight[id(job)] >= job.min_len for job in jobs]
            tokens = self.decoder.launch(slots, allow_stop, kv_len=max(job.kv_len for job in jobs))
            pending.append((tokens, [(job, job.segment) for job in jobs], slots))
            for job in jobs:
                job.kv_len += 1
        keep = self.settings.decode_steps_ahead if batch else 0
        while len(pending) > keep:
            self._read_tokens(pending.popleft())
        elapsed = time.perf_counter() - started
        for job, _ in batch:
            job.lm_s += elapsed
        return len(batch)

    def _read_tokens(self, pending: tuple[PendingTokens, list[tuple[SynthesisJob, int]], list[int]]) -> None:
        """Wait for a launched step and take its tokens, except for rows whose job has since
        finished its segment's LM (the step after a stop token), moved on, or left."""
        tokens = self._wait_for(pending[0])
        self._accept([(job, token) for (job, segment), token in zip(pending[1], tokens)
                      if job.slot is not None and job.segment == segment and not job.lm_finished])

    def _wait_for(self, tokens: PendingTokens) -> list[int]:
        """Carried tokens on the host; the wait counts into the iteration's `StepTiming.wait_s`."""
        started = time.perf_counter()
        out = tokens.result()
        self._last_wait_s += time.perf_counter() - started
        return out

    # ---- either thread ---------------------------------------------------------------------------
    def _fail(self, job: SynthesisJob, exc: BaseException) -> None:
        """Fail one job: its slot is freed and its sink hears the error once, whichever thread (or
        both) found the failure first."""
        if not self._release(job):
            return
        log.warning("tts_job_failed", call_id=job.call_id, error=repr(exc))
        job.sink.fail(exc if isinstance(exc, SynthesisError) else SynthesisError(f"synthesis failed: {exc!r}"))

    def _release(self, job: SynthesisJob) -> bool:
        """Take `job` out of service and free its KV slot; False if it was already out."""
        with self._cond:
            if job not in self._active:
                return False
            self._active.remove(job)
            if job.slot is not None:
                self._free_slots.append(job.slot)
                job.slot = None
            if job.token2wav is not None:
                job.token2wav.close()  # its flow slot too (idempotent: a final chunk closed it already)
            # A freed slot may let a waiting job in; the decode thread may be asleep.
            self._cond.notify()
            return True
