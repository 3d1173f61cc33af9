"""LMRunner: the speech LM on the decode thread (nano-vllm's `model_runner` role): each segment's
prefill and first draw, and batched decode steps whose tokens are drawn on the device.

Each cache slot keeps its last token and RAS window on the device (tts_core/accel/carried_decode.py),
so a step needs from the host only which slots step and which may stop, and its tokens are read a
step later: the decode thread launches step k+1, then reads step k (`decode_steps_ahead`), and the
GPU does not wait for the host between steps. With graphs the step is one replay
(`GraphedDecoder`); without (CPU) the same contract runs eagerly (`EagerCarriedDecoder`), so CPU
tests run the loop the GPU runs.

A segment's prefill and first draw go on a CUDA stream of their own; its job joins the steps once
the host sees its first token, so no step of the other jobs waits for a prefill.

Only the decode thread calls in here. It never touches the scheduler's lock or job lists: the
scheduler says which jobs step, and hands what this returns to the jobs.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.accel.carried_decode import EagerCarriedDecoder, PendingTokens
from tts_core.llm.sampling import SamplingConfig
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.runtime.request import SynthesisJob
from tts_core.runtime.settings import SchedulerSettings

# A step in flight: its tokens, the (job, segment) of each row, and the rows' slots (a row's job may
# have released its slot since).
Step = tuple[PendingTokens, list[tuple[SynthesisJob, int]], list[int]]


class LMRunner:
    def __init__(self, lm: SpeechTokenLM, sampling: SamplingConfig, settings: SchedulerSettings,
                 priority: int) -> None:
        self.lm = lm
        self.settings = settings
        self.cache = lm.kv_cache
        self.sampler = BatchedRasSampler(sampling, lm.speech_token_size)
        # Replaced by a GraphedDecoder (and a GraphedPrefill) in `capture` with graphs.
        self.decoder = EagerCarriedDecoder(lm, self.sampler)
        self.prefiller = None
        self._pending: deque[Step] = deque()
        self._seeded: dict[int, tuple[SynthesisJob, int]] = {}  # slot -> the segment its carried state is
        # Jobs whose prefill and first draw are launched, with their first token on its way.
        self.prefilling: list[tuple[SynthesisJob, int, PendingTokens]] = []
        self.wait_s = 0.0  # waiting for tokens to reach the host, since the caller last reset it
        # On CUDA with separate streams: prefills and first draws run here. It waits for the default
        # stream when the decode thread starts, and for the decode stream only before a prefill into
        # a slot that a step in flight still uses (`prefill_stream`).
        on_cuda = self.cache.device.type == "cuda"
        self._prefill_stream = (torch.cuda.Stream(self.cache.device, priority=priority)
                                if on_cuda and settings.separate_streams else None)

    def capture(self) -> dict:
        """The decode and prefill graphs (start-up, CUDA); returns each part's seconds."""
        from tts_core.accel.buckets import power_of_two_buckets
        from tts_core.accel.graph_capture import CaptureClock
        from tts_core.accel.lm_graphs import GraphedDecoder, GraphedPrefill

        s = self.settings
        report = {}
        t0 = time.perf_counter()
        clock = CaptureClock.now()
        attend = tuple(b for b in s.attend_buckets if b < s.max_len) + (s.max_len,)
        # Eager-module graphs: no tracing before ready; the compiled ones follow (`capture_compiled`).
        self.decoder = GraphedDecoder(self.lm, self.sampler, power_of_two_buckets(s.max_batch), attend,
                                      scratch_slot=s.max_batch, slot_attention=s.slot_attention, compile=False)
        report["decode_capture_s"] = time.perf_counter() - t0
        report["decode_stages"] = CaptureClock.now().since(clock)
        t0 = time.perf_counter()
        clock = CaptureClock.now()
        self.prefiller = GraphedPrefill(self.lm, tuple(b for b in s.prefill_buckets if b <= s.max_len))
        report["prefill_capture_s"] = time.perf_counter() - t0
        report["prefill_stages"] = CaptureClock.now().since(clock)
        return report

    def capture_compiled(self) -> dict:
        """Another thread, while serving: the decode step compiled and captured, published for the
        decode thread's next launch (GraphSwap). Returns its seconds and where they went."""
        from tts_core.accel.graph_capture import CaptureClock

        started = time.perf_counter()
        clock = CaptureClock.now()
        self.decoder.capture_compiled()
        return {"s": round(time.perf_counter() - started, 2), **CaptureClock.now().since(clock)}

    def thread_started(self) -> None:
        """On the decode thread, on its stream: prefills come after everything before this thread."""
        if self._prefill_stream is not None:
            self._prefill_stream.wait_stream(torch.cuda.current_stream(self.cache.device))

    @property
    def busy(self) -> bool:
        """Steps or first tokens on their way to the host."""
        return bool(self._pending or self.prefilling)

    @contextmanager
    def prefill_stream(self, slots: Sequence[int | None]) -> Iterator[None]:
        """Where this iteration's prefills run. A slot may still be a row of a step in flight (freed
        by a hang-up, or the job's own previous segment stepping on past its stop token): its cache
        row, length and carried state. A prefill into it must come after those steps. Other slots'
        prefills need not wait: a step writes only its own rows' slots."""
        if self._prefill_stream is None:
            yield
            return
        in_flight = {slot for _, _, step_slots in self._pending for slot in step_slots}
        if any(slot in in_flight for slot in slots):
            self._prefill_stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(self._prefill_stream):
            yield

    def prefill(self, job: SynthesisJob, slot: int, lm_input: torch.Tensor) -> None:
        """Launch the segment's prefill into `slot` and its first draw (inside `prefill_stream`);
        its first token is taken by `take_first_tokens`."""
        if self.prefiller is not None and self.prefiller.fits(lm_input.shape[0]):
            logp = self.prefiller.prefill(slot, lm_input)
        else:
            logp = self.lm.prefill([slot], [lm_input])
        first = self.decoder.draw_first([slot], logp, [job.min_len <= 0])
        job.kv_len = lm_input.shape[0]
        self.prefilling.append((job, job.segment, first))

    def first_token_ready(self) -> bool:
        return any(first.ready() for _, _, first in self.prefilling)

    def take_first_tokens(self) -> list[tuple[SynthesisJob, int]]:
        """The first tokens that reached the host, of jobs still on that segment; they join the next
        step, their slots' carried state already set on the device."""
        taken, left = [], []
        for job, segment, first in self.prefilling:
            if first.ready():
                token = self._result(first)[0]
                if job.slot is not None and job.segment == segment:
                    self._seeded[job.slot] = (job, segment)
                    taken.append((job, token))
            else:
                left.append((job, segment, first))
        self.prefilling = left
        return taken

    def rows_in_flight(self) -> Counter:
        """id(job) -> its rows in the steps launched and not yet read."""
        return Counter(id(job) for _, rows, _ in self._pending for job, _ in rows)

    def launch(self, batch: Sequence[tuple[SynthesisJob, int]], allow_stop: Sequence[bool]) -> None:
        """One decode step and draw for every (job, slot) of `batch`."""
        jobs, slots = [job for job, _ in batch], [slot for _, slot in batch]
        fresh = [(job, slot) for job, slot in batch if self._seeded.get(slot) != (job, job.segment)]
        if fresh:
            self.decoder.seed([slot for _, slot in fresh], [job.tokens for job, _ in fresh])
            for job, slot in fresh:
                self._seeded[slot] = (job, job.segment)
        tokens = self.decoder.launch(slots, allow_stop, kv_len=max(job.kv_len for job in jobs))
        self._pending.append((tokens, [(job, job.segment) for job in jobs], slots))
        for job in jobs:
            job.kv_len += 1

    @property
    def unread(self) -> int:
        return len(self._pending)

    def read_oldest(self) -> list[tuple[SynthesisJob, int, int]]:
        """Wait for the oldest step in flight: (job, segment, token) of each row."""
        tokens, rows, _ = self._pending.popleft()
        return [(job, segment, token) for (job, segment), token in zip(rows, self._result(tokens))]

    def _result(self, tokens: PendingTokens) -> list[int]:
        started = time.perf_counter()
        out = tokens.result()
        self.wait_s += time.perf_counter() - started
        return out
