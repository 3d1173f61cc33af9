"""SynthesisScheduler: what runs next on the device (nano-vllm's `scheduler` role): admission into
KV slots, the decode thread's loop, and retiring jobs; it starts and stops the render lanes.

The decode thread (here) drives the LM through `lm_runner.LMRunner`; the render threads
(`render_loop.RenderLoop`, first-chunk lanes and one later-chunk lane) own flow + HiFT. Split so
that LM decoding never waits for chunk rendering, and a new call's first chunk never waits for a
later-chunk call. On CUDA each thread issues its work on its own stream, decode on the highest
priority and later chunks on the lowest; only host ints (`job.tokens`) pass between them. Other
threads only `submit` jobs (their text already split and tokenised on the caller's thread) and
cancel them through their sinks.

One decode iteration:
1. drop cancelled jobs (their KV slot is free at once); retire the jobs whose last chunk the render
   thread handed out; admit waiting jobs while slots are free; launch a prefill and first draw for
   every job that starts a segment (new jobs, and jobs whose previous segment is fully rendered);
2. take the first tokens that reached the host; launch one batched decode step over the generating
   jobs that step now (continuous batching: each sits at its own position in its own cache row;
   `step_rows`: while a call waits for its first chunk, streams far ahead of their listener yield
   their rows to it), then read the oldest steps until `decode_steps_ahead` are unread, appending
   the tokens under the lock and waking the render threads when a chunk may be due.

With graphs, a `tts-compile` thread (graph_compile.py) runs once the loops serve: it compiles and captures the
compiled graphs and publishes them; the decode thread and each render lane swap them in at their own swap point
(tts_core/accel/graph_swap.py). Until then they replay graphs of the eager modules.

All shared state (the job lists, slots, the hand-over flags of `request.SynthesisJob`) is guarded
by one lock, under which both threads' conditions wait; neither thread polls, except an idle decode
thread waiting for a prefill's first token. A failure inside one job (prefill, rendering, its sink)
fails that job's sink only, from either thread.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from tts_core.accel.graph_swap import REAPER
from tts_core.flow import FlowModel
from tts_core.hift import HiftGenerator
from tts_core.llm.sampling import RasSampler
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.runtime.chunk_render import FlowPoolSettings
from tts_core.runtime.family import COSYVOICE2, RuntimeFamily
from tts_core.runtime.graph_compile import GraphCompile
from tts_core.runtime.lm_runner import LMRunner
from tts_core.runtime.render_loop import SAMPLE_RATE, RenderLoop, RenderTiming, device_stream
from tts_core.runtime.request import SynthesisError, SynthesisJob
from tts_core.runtime.settings import SchedulerSettings
from tts_core.runtime.step_rows import step_rows, yield_bound_s
from tts_core.voices import Voice

log = structlog.get_logger(__name__)
# In a job's first and last log lines: which process served it, where several engine workers write
# into one gateway log (the supervisor's engine_worker_started names each worker's pid).
_PID = os.getpid()

GIL_SWITCH_INTERVAL_S = 0.001  # as the gateway's packet clock sets it (gateway/app.py)
FIRST_TOKEN_POLL_S = 0.0005  # how often an idle decode thread looks for a prefill's first token


@dataclass(frozen=True)
class StepTiming:
    """One decode-thread iteration, given to `SynthesisScheduler.on_step` (benchmarks install it)."""

    batch: int  # jobs in the decode step
    prefills: int
    prefill_s: float
    decode_s: float
    wall_s: float  # the whole iteration (admission included)
    wait_s: float = 0.0  # of decode_s: waiting for a step's tokens
    first_wait_s: float = 0.0  # after decode_s, nothing to step: waiting for a prefill's first token


class SynthesisScheduler:
    def __init__(self, lm: SpeechTokenLM, sampler: RasSampler, flow: FlowModel, hift: HiftGenerator,
                 settings: SchedulerSettings = SchedulerSettings(), family: RuntimeFamily = COSYVOICE2) -> None:
        """`family`: what differs between CosyVoice2 and 3 (runtime/family.py): the chunk renderer and
        the filter between the LM's tokens and the flow's."""
        self.lm, self.sampler, self.flow, self.hift = lm, sampler, flow, hift
        self.settings = settings
        self.family = family
        # With graphs one extra cache row is the decode graphs' scratch slot, never a job's.
        self.cache = lm.setup_cache(settings.max_batch + (1 if settings.graphs else 0), settings.max_len)
        self.renderer = family.renderer(flow, hift, FlowPoolSettings(
            stream_slots=settings.max_batch, context_frames=settings.flow_context_frames,
            context_int8=settings.flow_context_int8,
            encoder_tokens=settings.flow_encoder_tokens, batches=settings.flow_batches,
            voice_slots=settings.flow_voice_slots, first_batches=settings.flow_first_batches,
            first_lanes=settings.first_chunk_lanes, compile=settings.compile_flow, compile_hift=settings.compile_hift,
            solve_parts=settings.flow_solve_parts, defer_later=settings.defer_flow_graphs))
        # Decode at the device's highest stream priority, first chunks next, later chunks lowest: when
        # several streams have kernels queued, the one a listener is waiting on goes first.
        high = min(torch.cuda.Stream.priority_range()) if self.cache.device.type == "cuda" else 0
        self._decode_priority = high
        self.runner = LMRunner(lm, sampler.config, settings, priority=high)
        # Seconds of speech per token (40 ms for CosyVoice2): how far a stream's decoded tokens reach.
        self._token_s = flow.cfg.token_mel_ratio * hift.cfg.samples_per_frame / SAMPLE_RATE
        self.capture_report: dict = {}
        self.graph_compile = GraphCompile(self.runner, self.renderer, self.cache.device, self._is_stopping)
        # Re-entrant: a job failed by the render thread while it holds the lock releases under it too.
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # the decode thread waits on it
        self._waiting: deque[SynthesisJob] = deque()
        self._active: list[SynthesisJob] = []  # admitted and not yet released; shared with the render loop
        self._free_slots = list(range(settings.max_batch))
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._release_reaper: Callable[[], None] | None = None
        renders: deque[RenderTiming] = deque(maxlen=10_000)
        wake = threading.Condition(self._lock)
        lanes = [("first", name, high // 2) for name in self.renderer.first_lanes]
        lanes.append(("later", "later", 0) if lanes else ("all", "later", 0))
        self.render_lanes = [RenderLoop(self._lock, self._active, self._cond, self._fail, self.renderer,
                                        settings.schedule, settings.defer_slack_s, settings.separate_streams,
                                        lane=kind, priority=priority, renders=renders, wake=wake, replays=name)
                             for kind, name, priority in lanes]
        self._renders = renders
        self.on_step: Callable[[StepTiming], None] | None = None  # benchmarks' hook, on the decode thread

    @property
    def renders(self) -> deque[RenderTiming]:
        return self._renders

    @property
    def decoder(self):
        """The LM runner's decoder (GraphedDecoder once captured, else EagerCarriedDecoder)."""
        return self.runner.decoder

    # ---- any thread ------------------------------------------------------------------------------
    def capture(self, voices: Sequence[Voice]) -> dict:
        """Capture every CUDA graph the loops will replay (before `start`; seconds, once per process),
        so no request pays for it. Returns what was captured and how long each part took. Registers
        the voices with the flow (their shared prompt frames) with or without graphs."""
        report = self.renderer.prepare(voices, self.settings.schedule, self.settings.graphs)
        if self.settings.graphs:
            report.update(self.runner.capture())
            torch.cuda.synchronize()
            report["capture_s"] = sum(v for k, v in report.items() if k.endswith("_capture_s"))
            log.info("tts_graphs_captured", **{k: v for k, v in report.items() if k.endswith(("_s", "_stages"))})
        self.capture_report = report
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
        # Graph groups replaced while serving are let go between calls, not beside one (accel/graph_swap.py).
        self._release_reaper = REAPER.hold_while(lambda: bool(self._active or self._waiting))
        self._thread = threading.Thread(target=self._run, name="tts-decode", daemon=True)
        self._thread.start()
        if self.settings.graphs:
            self.graph_compile.start()  # the compiled graphs, once serving

    def _is_stopping(self) -> bool:
        return self._stopping

    @property
    def graphs_state(self) -> str:
        """What the engine's health says of the graphs (engines.base.GraphsState): compiled, compiling, failed."""
        return self.graph_compile.state

    @property
    def capturing(self) -> bool:
        """Whether the compiled graphs are still being captured: serving on eager-module graphs."""
        return self.graph_compile.running

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until the compiled graphs are captured and published (benchmarks that time the
        compiled graphs); False if still capturing after `timeout`."""
        return self.graph_compile.wait(timeout)

    def submit(self, job: SynthesisJob) -> None:
        with self._cond:
            if self._stopping:
                raise SynthesisError("synthesis scheduler is stopped")
            job.timings.queued = time.perf_counter()
            self._waiting.append(job)
            self._cond.notify()
        if job.call_id:  # which worker took the call, said now: one killed mid-call logs nothing later
            log.info("tts_job_queued", call_id=job.call_id, pid=_PID)

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
        self.graph_compile.stop(timeout)
        if self._release_reaper is not None:
            self._release_reaper()
            self._release_reaper = None
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

    def late_streams(self, late_s: float) -> int:
        """Live streams whose listener has been out of audio for more than `late_s` (playout assumed to start at the
        first chunk, `SynthesisJob.slack`) while they still have audio to render: the runtime is behind real time,
        and one more stream would only stretch every stream's speech with more silence (an engine sheds on it)."""
        now = time.perf_counter()
        with self._cond:
            return sum(1 for job in self._active
                       if job.options.paced and not job.cancelled and not job.segment_rendered
                       and job.timings.first_chunk is not None and job.slack(now) < -late_s)

    def _wake_render(self) -> None:
        self.render_lanes[0].wake()  # one condition for all lanes: wakes them all

    # ---- the decode thread -----------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)  # thread-local
        with device_stream(self.cache.device, priority=self._decode_priority, separate=self.settings.separate_streams):
            self.runner.thread_started()
            while True:
                with self._cond:
                    while not self._stopping and not self._has_work():
                        self._cond.wait(self._rows()[1])
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
        jobs held for their first chunk or yielding to one (or their time to step, `_rows`)."""
        return self.runner.busy or self._has_new_work()  # or tokens on their way to read

    def _has_new_work(self) -> bool:
        """Under the lock: work besides reading tokens already on their way to the host."""
        if self._waiting and self._free_slots:
            return True
        if any(job.cancelled or job.segment_rendered for job in self._active):
            return True
        return bool(self._rows()[0])

    def _rows(self) -> tuple[list[SynthesisJob], float | None]:
        """Under the lock: the jobs that step now, and seconds until one will when none does
        (`step_rows`: streams far ahead yield to first chunks; a lone first chunk's render is not
        stepped beside)."""
        s = self.settings
        bound = yield_bound_s(s.yield_lead_s, s.defer_slack_s, s.schedule, self._token_s)
        return step_rows(self._active, time.perf_counter(), s.first_chunk_hold_s, bound, self._token_s)

    def _jobs(self) -> list[SynthesisJob]:
        """A snapshot of the active jobs: the render thread may release one while we iterate."""
        with self._cond:
            return list(self._active)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._drop_cancelled()
        starting = self._retire_rendered() + self._admit()
        prefilled = self._launch_prefills(starting) if starting else 0
        if self.runner.prefilling:
            self._take_first_tokens()
        t1 = time.perf_counter()
        self.runner.wait_s = 0.0
        batch = self._decode()
        t2 = time.perf_counter()
        idle = bool(self.runner.prefilling) and not batch and not self.runner.unread
        if idle:
            self._await_first_token()  # nothing else to do: wait for a first token, or other work
        t3 = time.perf_counter()
        if self.on_step is not None and (batch or prefilled or idle):
            self.on_step(StepTiming(batch, prefilled, t1 - t0, t2 - t1, t3 - t0, self.runner.wait_s, t3 - t2))

    def _drop_cancelled(self) -> None:
        for job in self._jobs():
            if job.cancelled and self._release(job):
                log.info("tts_job_cancelled", pid=_PID, **job.figures())

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
            log.info("tts_job_done", segments=len(job.segments), pid=_PID, **job.figures())
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
        now = time.perf_counter()
        for job in admitted:
            job.timings.admitted = now
        return admitted

    def _launch_prefills(self, jobs: list[SynthesisJob]) -> int:
        """Each job's next segment: its prefill and first draw, on the runner's prefill stream (its
        LM input built there too); the first tokens are taken once they reach the host."""
        launched = 0
        with self.runner.prefill_stream([job.slot for job in jobs]):
            for job in jobs:
                started = time.perf_counter()
                try:
                    _, slot, lm_input = self._start_segment(job)
                    self.runner.prefill(job, slot, lm_input)
                except Exception as exc:
                    self._fail(job, exc)
                    continue
                job.timings.prefill_s += time.perf_counter() - started
                launched += 1
        return launched

    def _await_first_token(self) -> None:
        """Wait until a prefill's first token is on the host or there is other work (a new call to
        admit, whose prefill should not queue behind the others'; a segment to retire; a job's time
        to step), then take what arrived. Polled: a CUDA event cannot be waited on together with
        the condition that `submit` and the render lanes notify."""
        with self._cond:
            while not self.runner.first_token_ready() and not self._has_new_work() and not self._stopping:
                self._cond.wait(FIRST_TOKEN_POLL_S)
        self._take_first_tokens()

    def _take_first_tokens(self) -> None:
        taken = self.runner.take_first_tokens()
        now = time.perf_counter()
        for job, _ in taken:
            if job.timings.prefill_done is None:
                job.timings.prefill_done = now
        self._accept(taken)

    def _start_segment(self, job: SynthesisJob) -> tuple[SynthesisJob, int, torch.Tensor]:
        """The next segment's LM input; hands the segment to the render thread, which sets up its
        rendering while the prefill runs. Returns (job, its slot, the prefill input)."""
        text = job.segments[job.segment + 1]
        prompt_text, prompt_speech = job.lm_prompt()
        lm_input = self.lm.build_prefill_input(text, prompt_text, prompt_speech)
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
            job.start_segment(min(min_len, max_len), max(max_len, 1), self.family.token_filter())
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
                wake = wake or job.lm_finished or len(job.flow_tokens) >= job.wake_render_at
        if wake:
            self._wake_render()

    def _decode(self) -> int:
        """Launch a step for the jobs that step now (`_rows`), then read the oldest steps until
        only `decode_steps_ahead` are unread (all of them when nothing was launched)."""
        in_flight = self.runner.rows_in_flight()
        with self._cond:  # slots read once, under the lock (see _start_segment)
            # A row whose steps in flight draw its last allowed token steps no further; a row whose
            # step in flight draws a stop token steps on until the host reads it (thrown away).
            batch = [(job, job.slot) for job in self._rows()[0] if len(job.tokens) + in_flight[id(job)] < job.max_len]
        started = time.perf_counter()
        if batch:
            self.runner.launch(batch, [len(job.tokens) + in_flight[id(job)] >= job.min_len for job, _ in batch])
        keep = self.settings.decode_steps_ahead if batch else 0
        while self.runner.unread > keep:
            # Not for rows whose job has since finished its segment's LM (the step after a stop
            # token), moved on, or left.
            self._accept([(job, token) for job, segment, token in self.runner.read_oldest()
                          if job.slot is not None and job.segment == segment and not job.lm_finished])
        elapsed = time.perf_counter() - started
        for job, _ in batch:
            job.lm_s += elapsed
        return len(batch)

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

