"""RenderLoop: a render thread of the scheduler, which turns the tokens that the decode thread
produces into audio chunks (flow + HiFT) and hands them to the jobs' sinks.

The scheduler runs one per lane of `ChunkRenderer`: "first" lanes render the first chunk of every
job (what a caller waits for in silence) and the "later" lane every other chunk. A large batched
later-chunk call costs 100-400 ms on a busy GPU; in one thread a new call's first chunk waited
behind it (H100, docs/PERF_NOTES.md: p95 first chunk 650 ms at 4
req/s). A job is of kind "first" until its first chunk is handed off, then "later"; a lane looks
only at jobs of its kind, and claims a job (`SynthesisJob.render_lane`, under the lock) from taking
its chunk until handing it off, so each job's render state has one owner at any time even with
several first lanes (a burst of new calls renders on them side by side: a small flow call is bound
by kernel launches, so two run at once at nearly the speed of one). Kind "all" (one thread) does
both.

A lane owns the render side of its jobs (chunk planner, deferred chunk, token -> waveform stream)
and its own CUDA stream. It waits on a condition until a chunk is due (the decode thread wakes it when
a job's token count reaches `job.wake_render_at` or its LM finishes; a deferred chunk wakes it by
a timed wait), then renders the due chunks most urgent first: jobs without audio yet, then the job
whose emitted audio runs out soonest, then unpaced jobs (`JobOptions.paced` False: audio collected
whole, e.g. a file render; never deferred on slack) (`SynthesisJob.deadline`).

It must never touch the LM, the KV cache or a job's slot (except through the scheduler's `fail`),
never start or retire a segment (it sets `segment_rendered` and wakes the decode thread, which
does), and never sleep to poll.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from tts_core.runtime.chunk_render import ChunkRenderer
from tts_core.runtime.request import ChunkTiming, SynthesisError, SynthesisJob
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import RenderedChunk

log = structlog.get_logger(__name__)

SAMPLE_RATE = 24_000
FP16_OVERFLOW_HINT = ": this model's activations overflow float16; run it in bf16 or float32 (engine.cosyvoice2.dtype)"


@dataclass(frozen=True)
class RenderTiming:
    chunks: int  # chunks in one render call (one batched flow call, then each job's vocoder)
    seconds: float
    lane: str = "all"
    flow_s: float = 0.0  # of `seconds`: the batched flow call (encoder + solve, until its stream is done)
    hift_s: float = 0.0  # of `seconds`: the vocoder calls and the copy to the host


@dataclass
class _Due:
    job: SynthesisJob
    task: ChunkTask
    tokens: list[int]  # the segment's flow tokens [0, task.token_end), copied under the lock
    lm_s: float = 0.0  # the job's decode time since its previous chunk, taken when rendering starts


def _still_wanted(due: list[_Due]) -> list[_Due]:
    """Without the chunks of jobs cancelled or failed since the lock was let go (not rendered)."""
    return [d for d in due if d.job.slot is not None and not d.job.cancelled]


def _render_started(due: list[_Due], at: float) -> None:
    for d in due:
        if d.job.timings.first_render_started is None:
            d.job.timings.first_render_started = at


def _is_first(d: _Due) -> bool:
    """The job's first audio: what the caller waits for in silence."""
    return d.job.timings.first_chunk is None


def device_stream(device: torch.device, priority: int, separate: bool) -> AbstractContextManager:
    """Enter a new CUDA stream of `priority` on `device`, which first waits for the default stream
    (where the weights, caches and graphs were made before the threads started). Nothing on CPU or
    without `separate`: the thread then issues on the default stream."""
    if device.type != "cuda" or not separate:
        return nullcontext()
    stream = torch.cuda.Stream(device, priority=priority)
    stream.wait_stream(torch.cuda.default_stream(device))
    return torch.cuda.stream(stream)


class RenderLoop:
    def __init__(self, lock: threading.RLock, jobs: list[SynthesisJob], decode_wake: threading.Condition,
                 fail: Callable[[SynthesisJob, BaseException], None], renderer: ChunkRenderer,
                 schedule: ChunkSchedule, defer_slack_s: float, separate_streams: bool, lane: str = "all",
                 priority: int = 0, renders: deque[RenderTiming] | None = None,
                 wake: threading.Condition | None = None, replays: str | None = None) -> None:
        """`lock` guards `jobs` (the scheduler's active jobs) and every hand-over flag of a job;
        `decode_wake` is the decode thread's condition on the same lock; `fail` fails one job.
        `lane`: the kind, "first", "later" or "all" (see the module); `replays`: the renderer's lane
        (graph set) it replays (default "later" for "later"/"all"); `priority`: its CUDA stream's;
        `renders`: where render calls are recorded, `wake`: the condition (on `lock`) the lanes
        wait on; both shared by the lanes, so that a job handed from one to the other is seen."""
        if lane not in ("first", "later", "all"):
            raise ValueError(f"render lane must be 'first', 'later' or 'all', not {lane!r}")
        self._lock = lock
        self._wake = wake if wake is not None else threading.Condition(lock)
        self._jobs = jobs
        self._decode_wake = decode_wake
        self._fail = fail
        self.renderer = renderer
        self.schedule = schedule
        self.lane = lane
        self._replays = replays or ("later" if lane in ("later", "all") else lane)  # the renderer's graph set
        self._batch = renderer.lanes[self._replays].max_batch
        self._priority = priority
        self.defer_slack_s = defer_slack_s  # read every round: may be changed between runs (benchmarks)
        self._separate_streams = separate_streams
        self._device = next(renderer.hift.parameters()).device
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.renders: deque[RenderTiming] = renders if renders is not None else deque(maxlen=10_000)

    # ---- other threads ---------------------------------------------------------------------------
    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"tts-render-{self._replays}", daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """A job gained tokens that may make a chunk due, or its LM finished, or a segment started."""
        with self._wake:
            self._wake.notify_all()

    def stop(self, timeout: float | None) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- the render thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local
        with device_stream(self._device, priority=self._priority, separate=self._separate_streams):
            while True:
                with self._wake:
                    work = self._wait_for_work()
                if work is None:
                    return
                setup, due = work
                try:
                    for job in setup:
                        self._start_rendering(job)
                    self._render_due(due)
                except Exception as exc:  # a bug outside any one job: fail what it held, keep serving
                    log.exception("tts_render_round_failed")
                    for job in setup + [d.job for d in due]:
                        self._fail(job, exc)  # once per job: a job failed already is not failed again

    def _wait_for_work(self) -> tuple[list[SynthesisJob], list[_Due]] | None:
        """Under the lock: the jobs whose rendering must be set up and the due chunks, sorted by
        deadline; waits until there are some (None: stopping).
        A chunk deferred on slack sets the wait's timeout to when its slack runs low."""
        while not self._stopping:
            now = time.perf_counter()
            setup, due, deferred, wake_at, cancelled = [], [], [], None, False
            for job in self._jobs:
                if job.cancelled:
                    cancelled = True  # the decode thread frees its slot; nothing more is rendered for it
                    continue
                if not self._owns(job):
                    continue
                if job.segment < 0 or job.segment_rendered:
                    continue  # between segments: the decode thread's turn
                if job.planner is None:
                    job.render_lane = self  # released once set up (_start_rendering)
                    setup.append(job)
                    continue
                task = job.next_chunk()
                if task is not None:
                    slack = job.slack(now)
                    if job.options.paced and slack > self.defer_slack_s:
                        # Wait so that chunks of many streams share one batched flow call
                        # (first chunks never wait: no slack before them). An unpaced job (audio
                        # collected whole) has no listener to pace it: it never waits, and ranks
                        # after the live streams (`deadline`), so it fills a call's free rows.
                        job.pending_chunk = task
                        deferred.append((slack, job, task))
                        at = now + slack - self.defer_slack_s
                        wake_at = at if wake_at is None else min(wake_at, at)
                    else:
                        job.render_lane = self  # released at its hand-off
                        due.append(_Due(job, task, job.flow_tokens[:task.token_end]))
                job.plan_wake()
            if cancelled:
                self._decode_wake.notify()
            if due and (self.lane == "later" or not any(_is_first(d) for d in due)):
                # A call is being made anyway: fill it with the deferred chunks closest to running
                # dry. One call of B streams costs far less than B calls (its fixed launch cost is
                # most of a small call), and a full call keeps the streams' chunks in step. Not
                # when a first chunk is due: that call stays small (see _render_due).
                deferred.sort(key=lambda item: item[0])
                for _, job, task in deferred[:max(0, self._batch - len(due))]:
                    job.pending_chunk = None
                    job.render_lane = self
                    job.plan_wake()
                    due.append(_Due(job, task, job.flow_tokens[:task.token_end]))
            if setup or due:
                due.sort(key=lambda d: d.job.deadline())
                return setup, due
            self._wake.wait(None if wake_at is None else max(0.0, wake_at - time.perf_counter()))
        return None

    @staticmethod
    def _hand_back(due: list[_Due]) -> None:
        """Under the lock: chunks this lane claimed and will not render now go back to their jobs,
        deferred and unclaimed, for the next round (of any lane of their kind)."""
        for d in due:
            d.job.pending_chunk = d.task
            d.job.render_lane = None

    def _owns(self, job: SynthesisJob) -> bool:
        """Under the lock: whether this lane may render the job's next chunk (of its kind, and not
        claimed by another lane)."""
        if job.render_lane is not None and job.render_lane is not self:
            return False
        return self.lane == "all" or (self.lane == "first") == (job.timings.first_chunk is None)

    def _start_rendering(self, job: SynthesisJob) -> None:
        """The segment's planner and token -> waveform stream, made here so that the stream's device
        tensors live on this thread's CUDA stream."""
        try:
            voice = job.voice
            schedule = job.options.schedule or self.schedule
            generator = torch.Generator(device=self._device).manual_seed(job.seed + job.segment + 1)
            stream = self.renderer.stream(voice, schedule, generator)
            planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
        except Exception as exc:
            self._fail(job, exc)
            return
        with self._lock:
            job.start_rendering(planner, stream)
            job.render_lane = None
            job.plan_wake()
            self._wake.notify_all()  # another lane of its kind may render its first chunk

    def _render_due(self, due: list[_Due]) -> None:
        """Render the most urgent chunks, up to the largest flow batch; the rest wait for the next
        round, re-sorted with whatever became due."""
        due = _still_wanted(due)
        # First chunks go in a call of their own: a call costs about its widest row's context times
        # its rows, so a first chunk (prompt context only) riding with 31 later chunks (long
        # contexts) would arrive several times later than alone. The later chunks go next call.
        # (A "first" or "later" lane only holds one kind.)
        firsts = [d for d in due if _is_first(d)]
        now = self._take(due, (firsts or due)[:self._batch])
        if now:
            self._render_batch(now)

    def _take(self, due: list[_Due], now: list[_Due]) -> list[_Due]:
        """`now` (some of `due`) render now, each charged its decode time since its last chunk; the
        rest of `due` go back for the next round. Returns `now`."""
        taken = {id(d) for d in now}
        rest = [d for d in due if id(d) not in taken]
        with self._lock:
            self._hand_back(rest)
            if rest:
                self._wake.notify_all()  # another lane of their kind may take them now
        for d in now:
            d.lm_s = d.job.take_lm_s()
        return now

    def _render_batch(self, due: list[_Due]) -> None:
        started = time.perf_counter()
        _render_started(due, started)
        try:
            outs = self.renderer.render([(d.job.token2wav, d.tokens, d.task) for d in due], lane=self._replays)
        except Exception as exc:
            if len(due) == 1:
                self._fail(due[0].job, exc)
                return
            for one in due:  # alone, so one bad job fails alone
                self._render_batch([one])
            return
        self.renders.append(RenderTiming(len(due), time.perf_counter() - started, self._replays,
                                         outs[0].flow_s if outs else 0.0, outs[0].hift_s if outs else 0.0))
        for d, out in zip(due, outs):
            self._hand_off(d, out)

    def _hand_off(self, d: _Due, out: RenderedChunk) -> None:
        job, task = d.job, d.task
        # Under the lock, so that no chunk reaches a sink after its job was cancelled, failed or
        # released (sinks never block).
        with self._lock:
            job.render_lane = None
            if job.slot is None or job.cancelled:
                return
            if not np.isfinite(out.audio).all():
                # NaN/inf would reach the caller as noise: end the call instead. In fp16 it is an
                # activation overflow (fp16 tops out at 65504), so the message says what to change.
                hint = FP16_OVERFLOW_HINT if self.renderer.dtype == torch.float16 else ""
                self._fail(job, SynthesisError(f"the model produced non-finite audio ({self.renderer.dtype}){hint}"))
                return
            try:
                handed = time.perf_counter()
                job.sink.put(out.audio)
                now = time.perf_counter()
            except Exception as exc:
                self._fail(job, exc)
                return
            lookahead = 0 if task.finalize else job.planner.schedule.lookahead_tokens
            if self.lane == "first":
                self._wake.notify_all()  # the job is "later"'s now
            job.record_chunk(ChunkTiming(segment=job.segment, index=task.index,
                                         tokens=task.token_end - task.token_offset - lookahead, lm_s=d.lm_s,
                                         flow_s=out.flow_s, hift_s=out.hift_s, handoff_s=now - handed,
                                         audio_s=len(out.audio) / SAMPLE_RATE, at_s=now - job.timings.submitted,
                                         flow_gpu_s=out.flow_gpu_s, hift_gpu_s=out.hift_gpu_s),
                             handed)
            if task.finalize:
                job.segment_rendered = True  # the decode thread starts the next segment or retires the job
                self._decode_wake.notify()
            elif len(job.timings.chunks) == 1:
                self._decode_wake.notify()  # its decoding may have been held for this chunk
