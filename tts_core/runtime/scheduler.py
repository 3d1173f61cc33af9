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
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch

from tts_core.flow import FlowModel
from tts_core.hift import HiftGenerator
from tts_core.llm.sampling import RasSampler
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.runtime.request import ChunkTiming, SynthesisError, SynthesisJob
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import Token2WavStream

log = structlog.get_logger(__name__)

SAMPLE_RATE = 24_000
ATTEND_BUCKET = 256  # KV columns read per decode step are a multiple of this

TextFrontend = Callable[[str], list[list[int]]]  # text -> text tokens per segment


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = 8
    max_len: int = 2048  # KV-cache positions per slot: prompt text + text + prompt speech + generated
    schedule: ChunkSchedule = ChunkSchedule()


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
        self.cache = lm.setup_cache(settings.max_batch, settings.max_len)
        self._hift_device = next(hift.parameters()).device
        self._cond = threading.Condition()
        self._waiting: deque[SynthesisJob] = deque()
        self._active: list[SynthesisJob] = []
        self._free_slots = list(range(settings.max_batch))
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.steps: deque[StepTiming] = deque(maxlen=10_000)

    # ---- any thread ------------------------------------------------------------------------------
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
        job.start_segment(ChunkPlanner(schedule, len(voice.flow_prompt_speech_token)),
                          Token2WavStream(self.flow, self.hift, voice, generator), min(min_len, max_len),
                          max(max_len, 1))
        return lm_input

    def _run_prefill(self, ready: list[tuple[SynthesisJob, torch.Tensor]]) -> None:
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
        due: list[tuple[SynthesisJob, ChunkTask]] = []
        for job in self._active:
            task = job.next_chunk()
            if task is not None:
                due.append((job, task))
        due.sort(key=lambda item: item[0].deadline())
        rendered = 0
        for job, task in due:
            while task is not None and job in self._active:
                self._render(job, task)
                rendered += 1
                task = job.next_chunk() if job in self._active else None
        return rendered

    def _render(self, job: SynthesisJob, task: ChunkTask) -> None:
        try:
            out = job.token2wav.render(job.tokens, task)
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
        # Read only the cache columns some job of the batch uses, rounded up to a bucket so the
        # step keeps a few fixed shapes (cheaper attention early on; capturable per bucket).
        longest = max(job.kv_len for job in batch) + 1
        attend_len = min(self.cache.max_len, -(-longest // ATTEND_BUCKET) * ATTEND_BUCKET)
        logp = self.lm.decode_step([job.slot for job in batch], [job.tokens[-1] for job in batch], attend_len)
        logp = logp.float().cpu()  # the one host copy of the step
        elapsed = time.perf_counter() - started
        for row, job in enumerate(batch):
            job.logp = logp[row]
            job.kv_len += 1
            job.lm_s_since_chunk += elapsed
        return len(batch)

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
