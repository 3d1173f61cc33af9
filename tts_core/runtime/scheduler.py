"""SynthesisScheduler: the one thread that owns the device, and what it runs next (nano-vllm's roles
of scheduler and model runner, which stay small enough here to share a file).

Every torch call on the models happens on this thread. Other threads only `submit` jobs (under a
`threading.Condition`) and cancel them through their sinks. One loop iteration:

1. drop cancelled jobs (their KV slot is free at once), admit waiting jobs while slots are free,
   and run one batched prefill for every job that starts a segment (new jobs, next segments);
2. sample one token per generating job from the step's logp (copied to the host once per step);
3. render the chunks that are due, most urgent first: jobs without audio yet, then the job whose
   emitted audio runs out soonest; hand each chunk to its sink;
4. one batched `decode_step` over all generating jobs (continuous batching: jobs join and leave
   at any step; each sits at its own position in its own cache row).

A failure inside one job (its prefill, sampling or chunk rendering) fails that job's sink only;
the loop goes on. The loop sleeps on the condition when there is no work, never polls.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from tts_core.flow import FlowModel
from tts_core.hift import HiftGenerator
from tts_core.llm.sampling import RasSampler
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.runtime.chunk_render import ChunkRenderer
from tts_core.runtime.request import ChunkTiming, SynthesisError, SynthesisJob
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import RenderedChunk, Token2WavStream
from tts_core.voices import Voice

log = structlog.get_logger(__name__)

SAMPLE_RATE = 24_000
ATTEND_BUCKET = 256  # KV columns read per decode step are a multiple of this

TextFrontend = Callable[[str], list[list[int]]]  # text -> text tokens per segment


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = 8
    max_len: int = 2048  # KV-cache positions per slot: prompt text + text + prompt speech + generated
    schedule: ChunkSchedule = ChunkSchedule()
    # Fast paths (see tts_core.runtime.chunk_render / window_flow and tts_core.accel):
    flow_window_tokens: int | None = None  # None: exact IncrementalFlow per job; N: bounded, batched flow
    graphs: bool = False  # CUDA only: captured decode (+ on-device sampling), prefill, flow and HiFT
    prefill_buckets: tuple[int, ...] = (128, 192, 256, 320, 384, 512)
    attend_buckets: tuple[int, ...] = (256, 512, 1024, 2048)
    flow_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    # Chunk rendering per loop iteration stops after this many seconds (the most urgent chunks go
    # first; the rest wait an iteration) so that every stream's decode steps keep flowing.
    render_budget_s: float = 0.05
    # Fast path: a later chunk whose stream still has more than this much unplayed audio waits, so
    # that chunks of many streams gather into one batched flow call instead of many small ones that
    # each stall every stream's decode step (first chunks never wait).
    defer_slack_s: float = 0.8


@dataclass(frozen=True)
class StepTiming:
    batch: int  # jobs in the decode step
    prefills: int
    prefill_s: float
    decode_s: float
    sample_s: float
    render_s: float
    chunks: int


class SynthesisScheduler:
    def __init__(self, lm: SpeechTokenLM, sampler: RasSampler, flow: FlowModel, hift: HiftGenerator,
                 frontend: TextFrontend, settings: SchedulerSettings = SchedulerSettings()) -> None:
        self.lm, self.sampler, self.flow, self.hift = lm, sampler, flow, hift
        self.frontend = frontend
        self.settings = settings
        # With graphs one extra cache row is the decode graphs' scratch slot, never a job's.
        self.cache = lm.setup_cache(settings.max_batch + (1 if settings.graphs else 0), settings.max_len)
        self._hift_device = next(hift.parameters()).device
        self.renderer = (ChunkRenderer(flow, hift, settings.flow_window_tokens)
                         if settings.flow_window_tokens is not None else None)
        self.decoder = None  # GraphedDecoder, once captured
        self.prefiller = None  # GraphedPrefill, once captured
        self.capture_report: dict = {}
        self._cond = threading.Condition()
        self._waiting: deque[SynthesisJob] = deque()
        self._active: list[SynthesisJob] = []
        self._free_slots = list(range(settings.max_batch))
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps: deque[StepTiming] = deque(maxlen=10_000)

    # ---- any thread ------------------------------------------------------------------------------
    def capture(self, voices: Sequence[Voice]) -> dict:
        """Capture every CUDA graph the loop will replay (before `start`; seconds, once per process),
        so no request pays for it. Returns what was captured and how long each part took."""
        if not self.settings.graphs:
            return {}
        from tts_core.accel.batched_sampler import BatchedRasSampler
        from tts_core.accel.buckets import power_of_two_buckets
        from tts_core.accel.lm_graphs import GraphedDecoder, GraphedPrefill

        s = self.settings
        report: dict = {}
        t0 = time.perf_counter()
        attend = tuple(b for b in s.attend_buckets if b < s.max_len) + (s.max_len,)
        self.decoder = GraphedDecoder(self.lm, power_of_two_buckets(s.max_batch), attend,
                                      scratch_slot=s.max_batch,
                                      sampler=BatchedRasSampler(self.sampler.config, self.lm.speech_token_size))
        report["decode_capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.prefiller = GraphedPrefill(self.lm, tuple(b for b in s.prefill_buckets if b <= s.max_len))
        report["prefill_capture_s"] = time.perf_counter() - t0
        if self.renderer is not None:
            t0 = time.perf_counter()
            report.update(self.renderer.capture(voices, s.schedule, s.flow_batches))
            report["flow_hift_capture_s"] = time.perf_counter() - t0
        torch.cuda.synchronize()
        report["capture_s"] = sum(v for k, v in report.items() if k.endswith("_capture_s"))
        self.capture_report = report
        log.info("tts_graphs_captured", **{k: v for k, v in report.items() if k.endswith("_s")})
        return report

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="tts-scheduler", daemon=True)
        self._thread.start()

    def submit(self, job: SynthesisJob) -> None:
        with self._cond:
            if self._stopping:
                raise SynthesisError("synthesis scheduler is stopped")
            self._waiting.append(job)
            self._cond.notify()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop the loop; jobs still waiting or running fail with SynthesisError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with self._cond:
            left = list(self._waiting) + self._active
            self._waiting.clear()
            self._active = []
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

    # ---- the device thread -------------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as exc:  # a bug outside any one job: fail what is running, keep serving
                log.exception("tts_scheduler_step_failed")
                for job in list(self._active):
                    self._fail(job, exc)

    def _step(self) -> None:
        t0 = time.perf_counter()
        self._drop_cancelled()
        starting = self._admit() + [j for j in self._active if j.segment_done and j.has_next_segment]
        prefilled = self._prefill(starting) if starting else 0
        t1 = time.perf_counter()
        self._sample()
        t2 = time.perf_counter()
        chunks = self._render_due()
        t3 = time.perf_counter()
        self._retire_finished()
        batch = self._decode()
        t4 = time.perf_counter()
        self.steps.append(StepTiming(batch, prefilled, t1 - t0, t4 - t3, t2 - t1, t3 - t2, chunks))

    def _drop_cancelled(self) -> None:
        for job in list(self._active):
            if job.cancelled:
                log.info("tts_job_cancelled", call_id=job.call_id, audio_s=round(job.audio_s, 3))
                self._release(job)

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

    def _prefill(self, jobs: list[SynthesisJob]) -> int:
        """One batched prefill for all `jobs`; if it fails, each job alone, so one bad job fails alone."""
        started = time.perf_counter()
        ready = []
        for job in jobs:
            try:
                ready.append((job, self._start_segment(job)))
            except Exception as exc:
                self._fail(job, exc)
        if not ready:
            return 0
        try:
            self._run_prefill(ready)
        except Exception as exc:
            if len(ready) == 1:
                self._fail(ready[0][0], exc)
                return 0
            for one in ready:
                try:
                    self._run_prefill([one])
                except Exception as exc:
                    self._fail(one[0], exc)
        elapsed = time.perf_counter() - started
        for job, _ in ready:
            job.timings.prefill_s += elapsed
            if job.timings.prefill_done is None:
                job.timings.prefill_done = time.perf_counter()
        return len(ready)

    def _start_segment(self, job: SynthesisJob) -> torch.Tensor:
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
        schedule = opts.schedule or self.settings.schedule
        generator = torch.Generator(device=self._hift_device).manual_seed(job.seed + job.segment + 1)
        stream = (self.renderer.stream(voice, schedule, generator) if self.renderer is not None
                  else Token2WavStream(self.flow, self.hift, voice, generator))
        job.start_segment(ChunkPlanner(schedule, len(voice.flow_prompt_speech_token)), stream,
                          min(min_len, max_len), max(max_len, 1))
        return lm_input

    def _run_prefill(self, ready: list[tuple[SynthesisJob, torch.Tensor]]) -> None:
        if self.prefiller is not None and all(x.shape[0] <= self.prefiller.length_buckets[-1] for _, x in ready):
            # One graph replay per job (batch-1 graphs); the host copy waits for them all.
            rows = [self.prefiller.prefill(job.slot, x).clone() for job, x in ready]
            logp = torch.cat(rows).float().cpu()
        else:
            logp = self.lm.prefill([job.slot for job, _ in ready], [x for _, x in ready]).float().cpu()
        for row, (job, lm_input) in enumerate(ready):
            job.logp = logp[row]
            job.kv_len = lm_input.shape[0]

    def _sample(self) -> None:
        for job in self._active:
            if job.logp is None:
                continue
            started = time.perf_counter()
            try:
                allow_stop = len(job.tokens) >= job.min_len
                token = self.sampler.sample(job.logp, job.tokens, job.sampling_generator, allow_stop)
                job.accept_token(token, self.lm.speech_token_size)
            except Exception as exc:
                self._fail(job, exc)
            job.lm_s_since_chunk += time.perf_counter() - started

    def _render_due(self) -> int:
        """Render due chunks, most urgent first, until the iteration's render budget is spent; the
        rest stay pending for the next iteration (after one more decode step for everyone)."""
        started = time.perf_counter()
        budget = self.settings.render_budget_s
        rendered = 0
        while True:
            due: list[tuple[SynthesisJob, ChunkTask]] = []
            now = time.perf_counter()
            for job in self._active:
                task = job.next_chunk()
                if task is None:
                    continue
                if self.renderer is not None and job.slack(now) > self.settings.defer_slack_s:
                    job.pending_chunk = task
                    continue
                due.append((job, task))
            if not due:
                return rendered
            due.sort(key=lambda item: item[0].deadline())
            if rendered and time.perf_counter() - started >= budget:
                for job, task in due:
                    job.pending_chunk = task
                return rendered
            if self.renderer is None:
                (job, task), rest = due[0], due[1:]
                self._render(job, task)
                rendered += 1
            else:
                take = max(self.settings.flow_batches)
                rest = due[take:]
                rendered += self._render_batch(due[:take])
            for job, task in rest:
                job.pending_chunk = task

    def _render(self, job: SynthesisJob, task: ChunkTask) -> None:
        try:
            out = job.token2wav.render(job.tokens, task)
        except Exception as exc:
            self._fail(job, exc)
            return
        self._hand_off(job, task, out)

    def _render_batch(self, due: list[tuple[SynthesisJob, ChunkTask]]) -> int:
        try:
            outs = self.renderer.render([(job.token2wav, job.tokens, task) for job, task in due])
        except Exception as exc:
            if len(due) == 1:
                self._fail(due[0][0], exc)
                return 0
            return sum(self._render_batch([one]) for one in due)  # alone, so one bad job fails alone
        for (job, task), out in zip(due, outs):
            self._hand_off(job, task, out)
        return len(due)

    def _hand_off(self, job: SynthesisJob, task: ChunkTask, out: RenderedChunk) -> None:
        try:
            handed = time.perf_counter()
            job.sink.put(out.audio)
            now = time.perf_counter()
        except Exception as exc:
            self._fail(job, exc)
            return
        lookahead = 0 if task.finalize else job.planner.schedule.lookahead_tokens
        tokens = task.token_end - task.token_offset - lookahead
        job.record_chunk(ChunkTiming(segment=job.segment, index=task.index, tokens=tokens,
                                     lm_s=job.lm_s_since_chunk, flow_s=out.flow_s, hift_s=out.hift_s,
                                     handoff_s=now - handed, audio_s=len(out.audio) / SAMPLE_RATE,
                                     at_s=now - job.timings.submitted), handed)

    def _retire_finished(self) -> None:
        for job in list(self._active):
            if job.segment_done and not job.has_next_segment:
                job.timings.finished = time.perf_counter()
                job.done = True
                self._release(job)  # before the sink hears the end, so a finished stream's slot is free
                job.sink.finish()
                log.info("tts_job_done", call_id=job.call_id, audio_s=round(job.audio_s, 3),
                         segments=len(job.segments), chunks=len(job.timings.chunks),
                         first_chunk_s=job.timings.since_submit(job.timings.first_chunk))

    def _decode(self) -> int:
        batch = [job for job in self._active if job.generating]
        if not batch:
            return 0
        started = time.perf_counter()
        longest = max(job.kv_len for job in batch)
        if self.decoder is not None:
            self._decode_graphed(batch, longest)
        else:
            # Read only the cache columns some job of the batch uses, rounded up to a bucket so the
            # step keeps a few fixed shapes (cheaper attention early on; capturable per bucket).
            attend_len = min(self.cache.max_len, -(-(longest + 1) // ATTEND_BUCKET) * ATTEND_BUCKET)
            logp = self.lm.decode_step([job.slot for job in batch], [job.tokens[-1] for job in batch], attend_len)
            logp = logp.float().cpu()  # the one host copy of the step
            for row, job in enumerate(batch):
                job.logp = logp[row]
                job.kv_len += 1
        elapsed = time.perf_counter() - started
        for job in batch:
            job.lm_s_since_chunk += elapsed
        return len(batch)

    def _decode_graphed(self, batch: list[SynthesisJob], longest: int) -> None:
        """Decode step and on-device RAS draw for every row in one graph replay; one host copy of
        the drawn tokens per step, whatever the batch."""
        window = self.decoder.sampler.config.win_size
        history = torch.tensor([([-1] * window + job.tokens)[-window:] for job in batch], dtype=torch.long)
        allow_stop = torch.tensor([len(job.tokens) >= job.min_len for job in batch])
        device = self.cache.device
        tokens = self.decoder.step_sample([job.slot for job in batch], [job.tokens[-1] for job in batch],
                                          history.to(device, non_blocking=True),
                                          allow_stop.to(device, non_blocking=True), kv_len=longest).tolist()
        for job, token in zip(batch, tokens):
            job.kv_len += 1
            job.accept_token(token, self.lm.speech_token_size)

    def _fail(self, job: SynthesisJob, exc: BaseException) -> None:
        log.warning("tts_job_failed", call_id=job.call_id, error=repr(exc))
        error = exc if isinstance(exc, SynthesisError) else SynthesisError(f"synthesis failed: {exc!r}")
        self._release(job)
        job.sink.fail(error)

    def _release(self, job: SynthesisJob) -> None:
        with self._cond:
            if job in self._active:
                self._active.remove(job)
            if job.slot is not None:
                self._free_slots.append(job.slot)
                job.slot = None
