"""The scheduler with stepped first chunks (`step_first_chunks`) on the tiny model: calls whose first
chunks step together get the audio that calls rendering each batch of first chunks in a call of its
own get, and a call that hangs up while its first chunk is stepping leaves the stepper at once
without disturbing the others."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.runtime import (
    CollectingSink,
    CosyVoice2Pipeline,
    JobOptions,
    SchedulerSettings,
    SynthesisError,
    SynthesisJob,
)

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960


def _load(model_dir: Path, stepped: bool) -> CosyVoice2Pipeline:
    return CosyVoice2Pipeline.load(model_dir, max_batch=3, max_len=1024,
                                   fast=SchedulerSettings(first_chunk_lanes=1, step_first_chunks=stepped))


@pytest.fixture(scope="module")
def stepped(tiny_model_dir: Path):
    torch.set_num_threads(1)
    pipeline = _load(tiny_model_dir, True)
    yield pipeline
    pipeline.close()


def _widest_step(pipeline: CosyVoice2Pipeline, monkeypatch) -> list[int]:
    """Records the rows of every step of the first lane's stepped flow."""
    flow = pipeline.scheduler.renderer.lanes["first-0"].stepped
    widths: list[int] = []
    real_step = flow.step

    def step():
        widths.append(len(flow.rows))
        return real_step()

    monkeypatch.setattr(flow, "step", step)
    return widths


def test_stepped_first_chunks_sound_like_first_chunks_rendered_in_calls(stepped: CosyVoice2Pipeline,
                                                                         tiny_model_dir: Path, monkeypatch) -> None:
    widths = _widest_step(stepped, monkeypatch)
    requests = [("Hello there.", 60, 3), ("Good morning to you.", 90, 4), ("One more call.", 120, 5)]
    plain = _load(tiny_model_dir, False)
    heard = []
    try:
        for pipeline in (stepped, plain):
            sinks = [CollectingSink() for _ in requests]
            for sink, (text, tokens, seed) in zip(sinks, requests):
                pipeline.synthesize(text, VOICE, sink, JobOptions(seed=seed, min_tokens=tokens, max_tokens=tokens))
            heard.append([np.concatenate(sink.wait(120)) for sink in sinks])
    finally:
        plain.close()
    assert plain.scheduler.renderer.lanes["first-0"].stepped is None
    assert max(widths) >= 2  # first chunks did step together
    for (_, tokens, _), a, b in zip(requests, *heard):
        assert len(a) == len(b) == tokens * SAMPLES_PER_TOKEN
        # Which calls share a batch moves the audio by up to ~1.3e-3 on its own (the same calls
        # rendered one after the other vs together); a row at a wrong step would move it by ~1.
        assert np.abs(a - b).max() <= 2e-3


def test_a_call_that_hangs_up_while_its_first_chunk_steps_leaves_at_once(stepped: CosyVoice2Pipeline,
                                                                         monkeypatch) -> None:
    renderer = stepped.scheduler.renderer
    flow = renderer.lanes["first-0"].stepped
    voice = stepped.voices.get(VOICE)
    leaving_sink, staying_sink = CollectingSink(), CollectingSink()
    leaving = SynthesisJob("A caller who hangs up.", voice, leaving_sink, JobOptions(seed=1, min_tokens=90,
                                                                                    max_tokens=90))
    staying = SynthesisJob("A caller who stays.", voice, staying_sink, JobOptions(seed=2, min_tokens=90,
                                                                                 max_tokens=90))
    dropped: list[SynthesisJob] = []
    real_step, real_drop = renderer.step_first, renderer.drop_first

    def step_first(lane):
        if any(row.key.key.job is leaving for row in flow.rows) and flow.rows[0].steps_done >= 3:
            leaving_sink.cancel()
        return real_step(lane)

    def drop_first(lane, keys):
        dropped.extend(d.job for d in keys)
        return real_drop(lane, keys)

    monkeypatch.setattr(renderer, "step_first", step_first)
    monkeypatch.setattr(renderer, "drop_first", drop_first)
    stepped.scheduler.submit(leaving)
    stepped.scheduler.submit(staying)
    assert len(np.concatenate(staying_sink.wait(120))) == 90 * SAMPLES_PER_TOKEN
    assert leaving_sink.cancelled and leaving_sink.chunks == []
    assert dropped == [leaving]
    assert not flow.rows and stepped.scheduler.free_slots == 3


def test_a_failed_step_fails_the_calls_in_flight_and_the_lane_serves_the_next(stepped: CosyVoice2Pipeline,
                                                                             monkeypatch) -> None:
    renderer = stepped.scheduler.renderer
    flow = renderer.lanes["first-0"].stepped
    real_step = renderer.step_first
    failed = []

    def step_first(lane):
        if not failed and flow.rows:
            failed.append(len(flow.rows))
            raise RuntimeError("step blew up")
        return real_step(lane)

    monkeypatch.setattr(renderer, "step_first", step_first)
    first_sink, next_sink = CollectingSink(), CollectingSink()
    stepped.synthesize("The first call.", VOICE, first_sink, JobOptions(seed=1, min_tokens=60, max_tokens=60))
    with pytest.raises(SynthesisError, match="step blew up"):
        first_sink.wait(60)
    assert failed == [1] and not flow.rows  # its row left with it
    stepped.synthesize("The next call.", VOICE, next_sink, JobOptions(seed=2, min_tokens=60, max_tokens=60))
    assert len(np.concatenate(next_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN
    assert stepped.scheduler.free_slots == 3
