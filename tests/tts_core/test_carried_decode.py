"""The carried decoder (tts_core/accel/carried_decode.py) on the tiny model, on CPU: the state it
keeps per slot on the device draws what host-built inputs draw, and the scheduler's overlapped
loop (step k+1 launched before step k's tokens are read) changes nothing but timing."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.accel.carried_decode import EagerCarriedDecoder, SlotTokens
from tts_core.runtime import (
    CollectingSink,
    CosyVoice2Pipeline,
    JobOptions,
    SchedulerSettings,
)

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960
STEPS: list = []  # StepTiming of every decode iteration of the module's pipeline


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path):
    torch.set_num_threads(1)
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, max_batch=3, max_len=1024,
                                       fast=SchedulerSettings())
    pipeline.scheduler.on_step = STEPS.append  # the decode thread's iterations, as bench_load collects them
    yield pipeline
    pipeline.close()


def test_slot_state_seeds_windows_and_advances_by_slot() -> None:
    state = SlotTokens(slots=4, window=3, device=torch.device("cpu"))
    state.seed([2, 0], [[5], [1, 2, 3, 4]])
    tokens, history = state.gather(torch.tensor([0, 2]))
    assert tokens.tolist() == [4, 5]
    assert history.tolist() == [[2, 3, 4], [-1, -1, 5]]
    state.advance(torch.tensor([2, 0]), history.flip(0), torch.tensor([9, 8]))
    tokens, history = state.gather(torch.tensor([0, 2, 1]))
    assert tokens.tolist() == [8, 9, 0]
    assert history.tolist() == [[3, 4, 8], [-1, 5, 9], [-1, -1, -1]]
    with pytest.raises(ValueError, match="at least one token"):
        state.seed([1], [[]])



def test_steps_ahead_are_bounded_by_the_decoders_host_buffers() -> None:
    """Three unread steps would reuse the pinned buffer of a step whose input copy may not have run."""
    assert SchedulerSettings(decode_steps_ahead=2).decode_steps_ahead == 2
    for bad in (-1, 3):
        with pytest.raises(ValueError, match="decode_steps_ahead must be 0..2"):
            SchedulerSettings(decode_steps_ahead=bad)

def test_carried_steps_draw_what_host_built_inputs_draw(pipeline: CosyVoice2Pipeline) -> None:
    """Two slots of different lengths, 12 steps: the carried decoder against the same step fed
    each row's last token and RAS window built on the host from its tokens (the old graphed
    path), with the same generator state. Cache and lengths are restored between the two runs."""
    lm = pipeline.scheduler.lm
    cache = lm.kv_cache
    sampler = BatchedRasSampler(pipeline.scheduler.sampler.config, lm.speech_token_size)
    window = sampler.config.win_size
    voice = pipeline.voices.get(VOICE)
    slots = [0, 2]
    inputs = [lm.build_prefill_input(text, voice.prompt_text, voice.llm_prompt_speech_token)
              for text in ([11, 12, 13], [21, 22, 23, 24, 25, 26, 27])]
    with torch.inference_mode():
        lm.prefill(slots, inputs)
    snapshot = cache.snapshot()
    first = [[3], [40, 41]]

    carried = EagerCarriedDecoder(lm, sampler, seed=7)
    carried.seed(slots, first)
    got = [list(t) for t in first]
    for _ in range(12):
        for row, token in enumerate(carried.launch(slots, [True, True], kv_len=60).result()):
            got[row].append(token)

    cache.restore(snapshot)
    generator = torch.Generator().manual_seed(7)
    want = [list(t) for t in first]
    with torch.inference_mode():
        for _ in range(12):
            history = torch.tensor([([-1] * window + t)[-window:] for t in want])
            logp = lm.decode_step(slots, [t[-1] for t in want], 256)
            drawn = sampler.sample(logp, history, torch.tensor([True, True]), generator)
            for row, token in enumerate(drawn.tolist()):
                want[row].append(token)
    assert got == want
    assert len({tuple(t) for t in got}) == 2  # the two rows are not one row's copy


class _StopAt:
    """The decoder's sampler, except that its `at`-th draw is a stop token for every row that may
    stop (the tiny random model rarely draws one by itself)."""

    def __init__(self, sampler: BatchedRasSampler, at: int) -> None:
        self.sampler, self.at, self.calls = sampler, at, 0
        self.config = sampler.config

    def sample(self, logp, history, allow_stop, generator=None):
        drawn = self.sampler.sample(logp, history, allow_stop, generator)
        self.calls += 1
        if self.calls == self.at:
            drawn = torch.where(allow_stop, torch.full_like(drawn, self.sampler.speech_token_size), drawn)
        return drawn


@pytest.mark.parametrize("stop", ["stop-token", "forced-count"])
def test_overlapped_steps_draw_what_one_step_at_a_time_draws(pipeline: CosyVoice2Pipeline, monkeypatch,
                                                              stop: str) -> None:
    """A job alone, reading each step's tokens before the next launch, one step behind and two
    behind: the same tokens, none after the end (a stop token at the 40th draw, or a forced count
    of 70, which the overlapped loop must not overshoot), and the audio of exactly those tokens."""
    scheduler = pipeline.scheduler
    decoder = scheduler.decoder
    results = []
    for ahead in (0, 1, 2):
        scheduler.settings = dataclasses.replace(scheduler.settings, decode_steps_ahead=ahead)
        decoder.generator.manual_seed(3)
        forced = 70 if stop == "forced-count" else None
        if stop == "stop-token":
            monkeypatch.setattr(decoder, "sampler", _StopAt(BatchedRasSampler(decoder.sampler.config,
                                                                               scheduler.lm.speech_token_size), 40))
        sink = CollectingSink()
        options = JobOptions(seed=4, min_tokens=0 if forced is None else forced, max_tokens=forced)
        job = pipeline.synthesize("Please hold while we connect your call.", VOICE, sink, options)
        audio = np.concatenate(sink.wait(120))
        assert all(t < scheduler.lm.speech_token_size for t in job.tokens)
        assert len(audio) == len(job.tokens) * SAMPLES_PER_TOKEN
        results.append(job.tokens)
    assert results[0] == results[1] == results[2]
    assert len(results[0]) == (70 if stop == "forced-count" else 39)


@pytest.mark.parametrize("ahead", [1, 2])
def test_jobs_join_leave_and_cancel_while_steps_overlap(pipeline: CosyVoice2Pipeline, ahead: int) -> None:
    """Three jobs of different lengths in one overlapped batch, one cancelled at its 100th token:
    the others get exactly their forced tokens, the cancelled one no token after it left, and its
    slot serves a new job."""
    scheduler = pipeline.scheduler
    scheduler.settings = dataclasses.replace(scheduler.settings, decode_steps_ahead=ahead)
    voice = pipeline.voices.get(VOICE)
    sinks = [CollectingSink() for _ in range(3)]
    counts = [40, 90, 300]
    jobs = [pipeline.make_job("Thank you for calling.", voice, sink, JobOptions(seed=i, min_tokens=n, max_tokens=n))
            for i, (sink, n) in enumerate(zip(sinks, counts))]
    accept = jobs[2].accept_token

    def accept_and_hang_up(token: int, speech_token_size: int) -> None:
        accept(token, speech_token_size)
        if len(jobs[2].tokens) == 100:
            sinks[2].cancel()

    jobs[2].accept_token = accept_and_hang_up
    for job in jobs:
        scheduler.submit(job)
    for sink, n in zip(sinks[:2], counts[:2]):
        assert sum(map(len, sink.wait(120))) == n * SAMPLES_PER_TOKEN
    deadline = time.monotonic() + 60
    while jobs[2].slot is not None and time.monotonic() < deadline:  # the decode thread frees it
        time.sleep(0.01)
    assert jobs[2].slot is None
    spoken = len(jobs[2].tokens)
    late = CollectingSink()
    pipeline.synthesize("Goodbye.", VOICE, late, JobOptions(seed=9, min_tokens=50, max_tokens=50))
    assert sum(map(len, late.wait(120))) == 50 * SAMPLES_PER_TOKEN
    assert spoken == 100 and len(jobs[2].tokens) == spoken
    assert any(step.batch >= 2 for step in STEPS)


class _LateFirstToken:
    """A first token that reaches the host only once `arrived` is set (a prefill still running
    on its own stream, as on a GPU)."""

    def __init__(self, tokens, arrived) -> None:
        self.tokens, self.arrived = tokens, arrived

    def ready(self) -> bool:
        return self.arrived.is_set() and self.tokens.ready()

    def result(self) -> list[int]:
        assert self.arrived.wait(60)
        return self.tokens.result()


def test_a_prefill_in_flight_stalls_no_other_call(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """While a new call's first token has not reached the host, the calls already speaking keep
    stepping and the new call is in no step; once it arrives the new call joins and speaks exactly
    its tokens."""
    scheduler = pipeline.scheduler
    scheduler.settings = dataclasses.replace(scheduler.settings, decode_steps_ahead=1)
    voice = pipeline.voices.get(VOICE)
    early_sink, late_sink = CollectingSink(), CollectingSink()
    early = pipeline.make_job("A long request.", voice, early_sink, JobOptions(seed=1, min_tokens=400, max_tokens=400))
    started = threading.Event()
    accept = early.accept_token

    def accept_and_tell(token: int, speech_token_size: int) -> None:
        accept(token, speech_token_size)
        if len(early.tokens) == 20:
            started.set()

    early.accept_token = accept_and_tell
    scheduler.submit(early)
    assert started.wait(60)

    arrived = threading.Event()
    real_draw_first = scheduler.decoder.draw_first
    monkeypatch.setattr(scheduler.decoder, "draw_first",
                        lambda *args: _LateFirstToken(real_draw_first(*args), arrived))
    late = pipeline.make_job("A short one.", voice, late_sink, JobOptions(seed=2, min_tokens=60, max_tokens=60))
    try:
        scheduler.submit(late)
        deadline = time.monotonic() + 60
        while late.kv_len == 0 and time.monotonic() < deadline:  # its prefill is launched
            time.sleep(0.005)
        at_launch = len(early.tokens)
        steps_before = len(STEPS)
        time.sleep(0.3)
        assert late.tokens == [] and late.timings.prefill_done is None
        assert len(early.tokens) > at_launch or early.lm_finished  # the early call kept stepping
        assert all(step.batch <= 1 for step in STEPS[steps_before:])  # without the late call
    finally:
        arrived.set()
    assert sum(map(len, late_sink.wait(120))) == 60 * SAMPLES_PER_TOKEN
    assert sum(map(len, early_sink.wait(120))) == 400 * SAMPLES_PER_TOKEN



def test_a_new_call_is_not_kept_waiting_behind_a_prefill_in_flight(pipeline: CosyVoice2Pipeline,
                                                                    monkeypatch) -> None:
    """Nothing is stepping and one call's first token has not reached the host: a call arriving
    meanwhile is admitted, prefilled and spoken without waiting for that token."""
    scheduler = pipeline.scheduler
    scheduler.settings = dataclasses.replace(scheduler.settings, decode_steps_ahead=1)
    voice = pipeline.voices.get(VOICE)
    arrived = threading.Event()
    real_draw_first = scheduler.decoder.draw_first
    withheld = []

    def draw_first(*args):
        first = real_draw_first(*args)
        if withheld:  # only the first call's token is held back
            return first
        withheld.append(first)
        return _LateFirstToken(first, arrived)

    monkeypatch.setattr(scheduler.decoder, "draw_first", draw_first)
    held_sink, new_sink = CollectingSink(), CollectingSink()
    held = pipeline.make_job("A held call.", voice, held_sink, JobOptions(seed=1, min_tokens=40, max_tokens=40))
    new = pipeline.make_job("A new call.", voice, new_sink, JobOptions(seed=2, min_tokens=30, max_tokens=30))
    try:
        scheduler.submit(held)
        deadline = time.monotonic() + 60
        while not withheld and time.monotonic() < deadline:  # its prefill is launched
            time.sleep(0.005)
        assert withheld
        scheduler.submit(new)
        assert sum(map(len, new_sink.wait(60))) == 30 * SAMPLES_PER_TOKEN
        assert held.tokens == []  # all of it while the held call's first token was still away
    finally:
        arrived.set()
    assert sum(map(len, held_sink.wait(120))) == 40 * SAMPLES_PER_TOKEN
