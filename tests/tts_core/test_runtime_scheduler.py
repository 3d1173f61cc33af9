"""The scheduler on the tiny model: segments in order in one stream, jobs joining a running batch,
per-job failure isolation (prefill, rendering), decoding that never waits for rendering,
cancellation, the deferred fast path, and the timings benchmarks read."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.runtime import (CollectingSink, CosyVoice2Pipeline, JobOptions, NothingToSpeak, SchedulerSettings,
                              SynthesisError, SynthesisJob)
from tts_core.voices import Voice

STEPS: list = []  # StepTiming of every decode iteration of the module's pipeline

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960
YIELD_LEAD_S = 3.0  # a stream this far ahead of its listener yields decode steps (tests that set it)


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path):
    torch.set_num_threads(1)
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, max_batch=3, max_len=1024)
    pipeline.scheduler.on_step = STEPS.append  # the decode thread's iterations, as bench_load collects them
    yield pipeline
    pipeline.close()


def _forced(tokens: int, seed: int = 1) -> JobOptions:
    return JobOptions(seed=seed, min_tokens=tokens, max_tokens=tokens)


def test_segments_are_spoken_in_order_in_one_stream(pipeline: CosyVoice2Pipeline) -> None:
    text = ("The first sentence tells you where you are calling and why we answer. "
            "The second sentence explains the options that you can choose from today. "
            "The third sentence thanks you for waiting on the line with us.")
    sink = CollectingSink()
    job = pipeline.synthesize(text, VOICE, sink, _forced(30))
    audio = np.concatenate(sink.wait(60))
    assert len(job.segments) >= 2
    assert len(audio) == len(job.segments) * 30 * SAMPLES_PER_TOKEN
    segments = [c.segment for c in job.timings.chunks]
    assert segments == sorted(segments) and set(segments) == set(range(len(job.segments)))


class _FirstChunkSink(CollectingSink):
    def __init__(self) -> None:
        super().__init__()
        self.first_chunk = threading.Event()

    def put(self, chunk: np.ndarray) -> None:
        super().put(chunk)
        self.first_chunk.set()


def test_a_job_joins_a_running_batch(pipeline: CosyVoice2Pipeline) -> None:
    early, late = _FirstChunkSink(), CollectingSink()
    first = pipeline.synthesize("A long request.", VOICE, early, _forced(300))
    # Submitted once the first job is already streaming: it must not wait for the first to end.
    assert early.first_chunk.wait(60)
    second = pipeline.synthesize("A short one.", VOICE, late, _forced(60))
    late.wait(60)
    early.wait(60)
    assert second.timings.finished < first.timings.finished
    assert any(step.batch == 2 for step in STEPS)


def test_a_bad_prefill_fails_only_its_job(pipeline: CosyVoice2Pipeline) -> None:
    good = pipeline.voices.get(VOICE)
    # Prompt speech token ids outside the embedding: the batched prefill breaks; only this job may fail.
    bad = Voice("bad_tokens", good.prompt_text, (10**6,) * 5, good.flow_prompt_speech_token,
                good.prompt_speech_feat, good.llm_embedding, good.flow_embedding)
    pipeline.voices.add(bad)
    bad_sink, good_sink = CollectingSink(), CollectingSink()
    pipeline.synthesize("Hello.", "bad_tokens", bad_sink, _forced(40))
    pipeline.synthesize("Hello.", VOICE, good_sink, _forced(40))
    with pytest.raises(SynthesisError):
        bad_sink.wait(60)
    assert sum(map(len, good_sink.wait(60))) == 40 * SAMPLES_PER_TOKEN
    assert pipeline.scheduler.free_slots == 3


def test_timings_cover_the_first_chunk(pipeline: CosyVoice2Pipeline) -> None:
    sink = CollectingSink()
    job = pipeline.synthesize("Timing check.", VOICE, sink, _forced(60))
    sink.wait(60)
    t = job.timings
    assert t.submitted <= t.admitted <= t.prefill_done <= t.first_token <= t.first_chunk <= t.finished
    first = t.chunks[0]
    assert first.tokens == 25 and first.flow_s > 0 and first.hift_s > 0 and first.lm_s > 0
    assert t.frontend_s + t.prefill_s + first.lm_s + first.flow_s + first.hift_s <= t.since_submit(t.first_chunk)
    assert sum(c.tokens for c in t.chunks) == 60
    # The job's last log line says whether the second chunk came before the first one's audio ran out.
    second = t.chunks[1]
    figures = job.figures()
    after = figures["second_chunk_after_ms"]
    assert after == pytest.approx((second.at_s - first.at_s) * 1e3, abs=0.1)
    assert figures["second_chunk_margin_ms"] == pytest.approx(first.audio_s * 1e3 - after, abs=0.2)
    assert 0 < figures["second_chunk_render_ms"] <= after


def test_a_call_s_job_names_its_process_when_queued_and_when_done(pipeline: CosyVoice2Pipeline) -> None:
    # Several engine workers log into one gateway log: the pid says which served a call, also for a
    # worker killed mid-call (only its tts_job_queued line exists then).
    import os

    from structlog.testing import capture_logs

    sink = CollectingSink()
    with capture_logs() as logs:
        pipeline.synthesize("Which worker?", VOICE, sink, _forced(30), call_id="call-7")
        sink.wait(60)
        deadline = time.monotonic() + 5
        while not any(e["event"] == "tts_job_done" for e in logs) and time.monotonic() < deadline:
            time.sleep(0.05)
    ours = [(e["event"], e["pid"]) for e in logs if e.get("call_id") == "call-7"]
    assert ours == [("tts_job_queued", os.getpid()), ("tts_job_done", os.getpid())]
    # The done line also says where the first chunk's render stage went (the benches read it from serve's log).
    done = next(e for e in logs if e.get("call_id") == "call-7" and e["event"] == "tts_job_done")
    assert done["first_render_flow_ms"] > 0 and done["first_render_hift_ms"] > 0 and done["first_render_handoff_ms"] >= 0
    assert done["first_render_flow_ms"] + done["first_render_hift_ms"] <= done["first_chunk_render_ms"] + 0.2  # rounding


def test_punctuation_only_text_is_refused_at_submit(pipeline: CosyVoice2Pipeline) -> None:
    """Nothing to say: refused on the caller's thread, before anything is queued (the official
    model would speak a blip of silence)."""
    sink = CollectingSink()
    with pytest.raises(NothingToSpeak, match="nothing to speak"):
        pipeline.synthesize("... !", VOICE, sink, _forced(30))
    assert sink.error is None and pipeline.scheduler.active_jobs == 0


def _wait_for(job: SynthesisJob, reached: Callable[[SynthesisJob], bool]) -> threading.Event:
    """An event set on the decode thread once `reached(job)` holds after a token (hook it before
    submitting the job)."""
    event = threading.Event()
    accept = job.accept_token

    def accept_and_tell(token: int, speech_token_size: int) -> None:
        accept(token, speech_token_size)
        if reached(job):
            event.set()

    job.accept_token = accept_and_tell
    return event


def _wait_lm_finished(job: SynthesisJob) -> threading.Event:
    return _wait_for(job, lambda j: j.lm_finished)


class _HeldRenders:
    """Records every render call (lane, [(stream, chunk index)]) and holds the first call on a lane
    that `hold(lane)` picks (with `every`, each such call) until `release` is set."""

    def __init__(self, pipeline: CosyVoice2Pipeline, monkeypatch, hold, every: bool = False) -> None:
        self.calls: list[tuple[str, list[tuple[object, int]]]] = []
        self.held, self.release = threading.Event(), threading.Event()
        real_render = pipeline.scheduler.renderer.render

        def render(items, lane="later"):
            self.calls.append((lane, [(stream, task.index) for stream, _, task in items]))
            if hold(lane) and (every or not self.held.is_set()):
                self.held.set()
                assert self.release.wait(60)
            return real_render(items, lane=lane)

        monkeypatch.setattr(pipeline.scheduler.renderer, "render", render)
        self.scheduler = pipeline.scheduler

    def submit_while_held(self, first: SynthesisJob, second: SynthesisJob) -> int:
        """Submit `first`; once a call is held, submit `second` and wait for its first chunk; then
        let the held call go. Returns how many chunks `first`'s sink had while its call was held."""
        try:
            self.scheduler.submit(first)
            assert self.held.wait(60)
            self.scheduler.submit(second)
            assert second.sink.first_chunk.wait(60)  # out while the held call is still held
            assert not self.release.is_set()
            return len(first.sink.chunks)
        finally:
            self.release.set()


def test_decoding_goes_on_while_a_chunk_renders(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """The point of the decode/render split: a render call that takes long (a batched flow call on
    a busy GPU) must not stall any stream's LM steps."""
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: True, every=True)
    entered, release = renders.held, renders.release
    first_sink, late_sink = CollectingSink(), CollectingSink()
    try:
        first = pipeline.synthesize("A long request.", VOICE, first_sink, _forced(150))
        assert entered.wait(60)  # the render thread now holds `first`'s first chunk
        held_at = len(first.tokens)
        late = pipeline.make_job("A short one.", pipeline.voices.get(VOICE), late_sink, _forced(60))
        late_lm_done = _wait_lm_finished(late)
        pipeline.scheduler.submit(late)
        # A job submitted while the render is held is admitted, prefilled and decoded to its end.
        assert late_lm_done.wait(60)
        assert len(late.tokens) == 60 and len(first.tokens) > held_at
        assert not release.is_set() and first_sink.chunks == [] and late_sink.chunks == []
    finally:
        release.set()
    assert sum(map(len, first_sink.wait(60))) == 150 * SAMPLES_PER_TOKEN
    assert sum(map(len, late_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN


def test_decoding_pauses_while_every_generating_job_waits_for_its_first_chunk(pipeline: CosyVoice2Pipeline,
                                                                              monkeypatch) -> None:
    """first_chunk_hold_s: while every generating job has drawn its first chunk's tokens and waits
    for that chunk, no decode step runs (a lone call's first chunk renders with the GPU to itself);
    a job that needs steps ends the pause for all of them; every job still speaks all its tokens."""
    monkeypatch.setattr(pipeline.scheduler, "settings",
                        dataclasses.replace(pipeline.scheduler.settings, first_chunk_hold_s=60.0))
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: True, every=True)
    entered, release = renders.held, renders.release
    first_sink, late_sink = CollectingSink(), CollectingSink()
    try:
        first = pipeline.synthesize("A long request.", VOICE, first_sink, _forced(150))
        assert entered.wait(60)  # its first chunk is rendering (held), its tokens all drawn
        time.sleep(0.1)  # the decoder runs one step ahead: let the step already in flight land (seen: 29 vs 28)
        held_at = len(first.tokens)
        assert first.timings.first_chunk_due is not None and held_at < 150
        time.sleep(0.3)
        assert len(first.tokens) == held_at  # alone: no step while its first chunk renders
        late = pipeline.make_job("A short one.", pipeline.voices.get(VOICE), late_sink, _forced(60))
        late_due = _wait_for(late, lambda j: j.timings.first_chunk_due is not None)
        pipeline.scheduler.submit(late)
        assert late_due.wait(60)  # `late` needed steps: they ran, and `first` took part in them
        time.sleep(0.1)  # the step in flight lands first
        resumed_at = len(first.tokens)
        assert resumed_at > held_at
        time.sleep(0.3)  # now both wait for their first chunks: paused again
        assert len(first.tokens) == resumed_at and len(late.tokens) < 60
    finally:
        release.set()
    assert sum(map(len, first_sink.wait(60))) == 150 * SAMPLES_PER_TOKEN
    assert sum(map(len, late_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN


def test_a_first_chunk_hold_ends_after_its_limit(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    # A render that takes longer than the hold: decoding resumes on the decode thread's own timer.
    monkeypatch.setattr(pipeline.scheduler, "settings",
                        dataclasses.replace(pipeline.scheduler.settings, first_chunk_hold_s=0.2))
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: True, every=True)
    entered, release = renders.held, renders.release
    sink = CollectingSink()
    try:
        job = pipeline.make_job("A long request.", pipeline.voices.get(VOICE), sink, _forced(150))
        lm_done = _wait_lm_finished(job)
        pipeline.scheduler.submit(job)
        assert entered.wait(60)
        assert lm_done.wait(60)  # long before the render is let go
        assert sink.chunks == []
    finally:
        release.set()
    assert sum(map(len, sink.wait(60))) == 150 * SAMPLES_PER_TOKEN


class _CancelOnFirstChunk(CollectingSink):
    """Hangs up as its first chunk arrives (on the render thread: no race with a later chunk)."""

    def put(self, chunk: np.ndarray) -> None:
        super().put(chunk)
        self.cancel()


def test_a_first_chunk_renders_while_a_later_chunk_call_is_held(pipeline: CosyVoice2Pipeline,
                                                                monkeypatch) -> None:
    """A new call's first chunk must not wait for other streams' later chunks: while a later-chunk
    call is in progress (held here), the first chunk of a call submitted meanwhile is rendered and
    handed to its sink, alone in its call, on the first-chunk lane."""
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane == "later")  # A's second chunk
    calls = renders.calls
    voice = pipeline.voices.get(VOICE)
    a_sink, b_sink = CollectingSink(), _FirstChunkSink()
    a = pipeline.make_job("A long request.", voice, a_sink, _forced(300))
    b = pipeline.make_job("A short one.", voice, b_sink, _forced(60))
    assert renders.submit_while_held(a, b) == 1  # B's first chunk out while A's later-chunk call is held
    assert sum(map(len, a_sink.wait(60))) == 300 * SAMPLES_PER_TOKEN
    assert sum(map(len, b_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN
    assert {lane.split("-")[0] for lane, _ in calls} == {"first", "later"}
    for lane, call in calls:  # every job's chunk 0 on a first lane, every other chunk on "later"
        assert all((index == 0) == lane.startswith("first-") for _, index in call)
    b_first = next(call for lane, call in calls if any(st is b.token2wav and i == 0 for st, i in call))
    assert len(b_first) == 1


def test_first_chunks_of_a_burst_render_side_by_side(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """While one first-chunk lane is busy (held here) with a call's first chunk, the next call's
    first chunk goes out on another first lane; every chunk is rendered exactly once."""
    assert len(pipeline.scheduler.renderer.first_lanes) >= 2
    # Holds the first call's first chunk.
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane.startswith("first-"))
    calls = renders.calls
    voice = pipeline.voices.get(VOICE)
    a_sink, b_sink = CollectingSink(), _FirstChunkSink()
    a = pipeline.make_job("A first call.", voice, a_sink, _forced(100))
    b = pipeline.make_job("A second call.", voice, b_sink, _forced(100))
    assert renders.submit_while_held(a, b) == 0  # B's first chunk out while A's first chunk is held
    for sink in (a_sink, b_sink):
        assert sum(map(len, sink.wait(60))) == 100 * SAMPLES_PER_TOKEN
    first_lanes = {lane for lane, call in calls if any(i == 0 for _, i in call)}
    assert len(first_lanes) == 2 and all(lane.startswith("first-") for lane in first_lanes)
    rendered = [(stream, i) for _, call in calls for stream, i in call]
    assert len(rendered) == len({(id(st), i) for st, i in rendered})  # no chunk twice


def test_a_cancelled_job_frees_its_slot_and_gets_no_more_audio(pipeline: CosyVoice2Pipeline) -> None:
    sink = _CancelOnFirstChunk()
    job = pipeline.synthesize("A long request that the caller hangs up on.", VOICE, sink, _forced(400))
    other_sink = CollectingSink()
    # Submitted after the hang-up is possible; it streams 150 tokens, long enough for the cancelled
    # job's next chunks to have been due had it kept going.
    other = pipeline.make_job("Another call.", pipeline.voices.get(VOICE), other_sink, _forced(150))
    other_started = _wait_lm_finished(other)
    pipeline.scheduler.submit(other)
    assert other_started.wait(60)
    other_sink.wait(60)
    assert len(sink.chunks) == 1 and sink.error is None
    assert job.slot is None and len(job.tokens) < 400
    assert pipeline.scheduler.free_slots == 3


def test_a_render_failure_fails_only_its_job(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    good = pipeline.voices.get(VOICE)
    pipeline.voices.add(dataclasses.replace(good, name="breaks_at_chunk_1"))

    renderer = pipeline.scheduler.renderer
    real_render = renderer.render

    def breaking_render(items, lane="later"):
        bad = renderer.voice(pipeline.voices.get("breaks_at_chunk_1"))
        if any(stream.flow.voice is bad and task.index == 1 for stream, _, task in items):
            raise RuntimeError("flow blew up")
        return real_render(items, lane=lane)

    monkeypatch.setattr(renderer, "render", breaking_render)
    bad_sink, good_sink = CollectingSink(), CollectingSink()
    pipeline.synthesize("Hello there.", "breaks_at_chunk_1", bad_sink, _forced(120))
    pipeline.synthesize("Hello there.", VOICE, good_sink, _forced(120))
    with pytest.raises(SynthesisError, match="flow blew up"):
        bad_sink.wait(60)
    assert len(bad_sink.chunks) == 1  # its first chunk went out before the failure
    assert sum(map(len, good_sink.wait(60))) == 120 * SAMPLES_PER_TOKEN
    assert pipeline.scheduler.free_slots == 3


def test_non_finite_audio_fails_only_its_call(pipeline: CosyVoice2Pipeline) -> None:
    # A voice whose speaker vector is NaN makes NaN mel and audio; rendered in the same batched calls
    # as a healthy job, it must fail alone and none of its samples may reach its sink.
    good = pipeline.voices.get(VOICE)
    pipeline.voices.add(dataclasses.replace(good, name="nan_speaker",
                                            flow_embedding=torch.full_like(good.flow_embedding, float("nan"))))
    bad_sink, good_sink = CollectingSink(), CollectingSink()
    pipeline.synthesize("Hello there.", "nan_speaker", bad_sink, _forced(120))
    pipeline.synthesize("Hello there.", VOICE, good_sink, _forced(120))
    with pytest.raises(SynthesisError, match="non-finite audio"):
        bad_sink.wait(60)
    assert bad_sink.chunks == []
    audio = np.concatenate(good_sink.wait(60))
    assert len(audio) == 120 * SAMPLES_PER_TOKEN and np.isfinite(audio).all()
    assert pipeline.scheduler.free_slots == 3


def test_fast_path_renders_deferred_chunks_when_their_slack_runs_low(tiny_model_dir: Path) -> None:
    """Batched fast path: later chunks wait while their stream has more than `defer_slack_s` of audio
    ahead; with nothing else running, only the render thread's timed wait can bring them out."""
    # The tiny LM decodes a 50-token hop in far less than the 1 s of audio the first chunk holds, so
    # an undeferred second chunk would go out with ~1 s ahead, well above this slack.
    fast = SchedulerSettings(defer_slack_s=0.3)
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, max_batch=2, max_len=1024, fast=fast)
    try:
        sink = CollectingSink()
        job = pipeline.synthesize("Fast path.", VOICE, sink, _forced(100))
        assert sum(map(len, sink.wait(60))) == 100 * SAMPLES_PER_TOKEN
        chunks = job.timings.chunks
        assert len(chunks) >= 3 and sum(c.tokens for c in chunks) == 100
        renders = list(pipeline.scheduler.renders)
        assert sum(r.chunks for r in renders) >= len(chunks) and all(r.seconds > 0 for r in renders)
        # A chunk that waited went out while the audio before it still played, with at most the slack left.
        first_at = chunks[0].at_s
        for i, c in enumerate(chunks[1:], 1):
            ahead = first_at + sum(x.audio_s for x in chunks[:i]) - c.at_s
            assert ahead <= fast.defer_slack_s + 0.05
    finally:
        pipeline.close()


class _Launches:
    """Records every decode step the runner launches: (its jobs, each job's lead then, whether a live
    job was waiting for its first chunk, the jobs with no first chunk yet)."""

    def __init__(self, pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
        self.steps: list[tuple[set[int], dict[int, float], bool, set[int]]] = []
        scheduler = pipeline.scheduler
        runner, launch = scheduler.runner, scheduler.runner.launch
        token_s = SAMPLES_PER_TOKEN / 24_000

        def recording_launch(batch, allow_stop):
            now = time.perf_counter()
            with scheduler._cond:
                active = list(scheduler._active)
                unheard = {id(j) for j in active if j.timings.first_chunk is None}
                pressing = any(j.options.paced and id(j) in unheard for j in active)
                leads = {id(j): j.lead_s(now, token_s) for j in active if j.generating}
            self.steps.append(({id(job) for job, _ in batch}, leads, pressing, unheard))
            launch(batch, allow_stop)

        monkeypatch.setattr(runner, "launch", recording_launch)


def _played_in_time(job: SynthesisJob) -> bool:
    """Every chunk after the first was handed out before the audio before it had played."""
    chunks = job.timings.chunks
    return all(c.at_s <= chunks[0].at_s + sum(x.audio_s for x in chunks[:i]) for i, c in enumerate(chunks[1:], 1))


def _far_stream(pipeline: CosyVoice2Pipeline) -> tuple[SynthesisJob, CollectingSink]:
    """A live stream submitted and now far ahead of its listener, still generating: its first chunk out
    (1 s of audio) and 6 s more of tokens drawn. (12 s in all: the tiny model's CPU flow re-reads every
    token, and a longer stream's later chunks take ~0.7 s, near the 0.8 s they are rendered ahead.)"""
    sink = CollectingSink()
    far = pipeline.make_job("A long request.", pipeline.voices.get(VOICE), sink, _forced(300))
    ahead = _wait_for(far, lambda j: j.timings.first_chunk is not None and len(j.tokens) - j.tokens_rendered > 150)
    pipeline.scheduler.submit(far)
    assert ahead.wait(60)
    assert not far.lm_finished  # still generating: it could step
    return far, sink


def _far_stream_recorded(pipeline: CosyVoice2Pipeline,
                         monkeypatch) -> tuple[_Launches, SynthesisJob, CollectingSink]:
    """`_far_stream` under `yield_lead_s` = YIELD_LEAD_S, every decode step recorded from its start."""
    monkeypatch.setattr(pipeline.scheduler, "settings",
                        dataclasses.replace(pipeline.scheduler.settings, yield_lead_s=YIELD_LEAD_S))
    launches = _Launches(pipeline, monkeypatch)
    return (launches, *_far_stream(pipeline))


@pytest.mark.parametrize("max_hop", [50, 100, 200])
def test_a_stream_that_yields_already_holds_its_next_chunks_tokens_whatever_the_hop(pipeline: CosyVoice2Pipeline,
                                                                                      max_hop: int) -> None:
    """The yield bound against the schedule (`step_rows.yield_bound_s`): a stream left out of the steps has
    more than the bound of speech ahead; when its next chunk falls due (`defer_slack_s` of audio left) the rest
    is decoded tokens, which must cover the longest hop and the lookahead, or that chunk waits on tokens the
    stream was told not to decode. CosyVoice3's default hop is 100, where the 4-s setting alone fell short."""
    from tts_core.runtime.step_rows import yield_bound_s
    from tts_core.streaming.chunk_schedule import ChunkSchedule

    settings = SchedulerSettings(schedule=ChunkSchedule(max_hop_tokens=max_hop))
    token_s = pipeline.scheduler._token_s  # seconds of speech a token reaches (40 ms)
    bound = yield_bound_s(settings.yield_lead_s, settings.defer_slack_s, settings.schedule, token_s)
    tokens_when_due = (bound - settings.defer_slack_s) / token_s
    assert tokens_when_due >= max_hop + settings.schedule.lookahead_tokens - 1e-9
    assert bound >= settings.yield_lead_s  # never below the setting (CosyVoice2's 50: the measured 4 s itself)
    assert yield_bound_s(0.0, settings.defer_slack_s, settings.schedule, token_s) == 0.0  # off stays off


def test_streams_far_ahead_yield_decode_steps_to_a_first_chunk(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """Deadline-aware decoding (yield_lead_s): while a new call waits for its first chunk, a stream
    whose speech runs more than yield_lead_s ahead of its listener is left out of the decode steps,
    and only then; it is never starved: every chunk of both reaches its sink before the audio before
    it has played out."""
    launches, far, far_sink = _far_stream_recorded(pipeline, monkeypatch)
    new_sink = _FirstChunkSink()
    new = pipeline.make_job("A short one.", pipeline.voices.get(VOICE), new_sink, _forced(60))
    pipeline.scheduler.submit(new)
    assert new_sink.first_chunk.wait(60)
    assert sum(map(len, new_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN
    assert sum(map(len, far_sink.wait(60))) == 300 * SAMPLES_PER_TOKEN
    new_first = [(jobs, leads) for jobs, leads, pressing, _ in launches.steps if id(new) in jobs and pressing]
    assert new_first, "the new call's first-chunk tokens were stepped"
    yielded = [leads[id(far)] for jobs, leads in new_first if id(far) in leads and id(far) not in jobs]
    assert yielded, "the far stream skipped the new call's first-chunk steps"
    # It yielded only while far ahead (a step's worth of slack for the time between choosing the
    # rows and launching them), and stepped beside the new call again once its lead ran low.
    assert min(yielded) > YIELD_LEAD_S - 0.1
    skipped = [leads[id(far)] for jobs, leads, pressing, _ in launches.steps
               if pressing and id(far) in leads and id(far) not in jobs]
    assert min(skipped) > YIELD_LEAD_S - 0.1
    assert _played_in_time(far) and _played_in_time(new)


def test_a_first_chunk_renders_with_no_step_beside_it_while_the_others_are_far_ahead(
        pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """The first-chunk hold counts only the jobs left to step: while a new call's first chunk renders
    and the only other stream is far ahead of its listener, no decode step runs beside that render;
    both still speak all their tokens."""
    monkeypatch.setattr(pipeline.scheduler, "settings", dataclasses.replace(
        pipeline.scheduler.settings, yield_lead_s=YIELD_LEAD_S, first_chunk_hold_s=60.0))
    armed = threading.Event()
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane.startswith("first-") and armed.is_set())
    far, far_sink = _far_stream(pipeline)
    new_sink = CollectingSink()
    try:
        armed.set()
        new = pipeline.make_job("A short one.", pipeline.voices.get(VOICE), new_sink, _forced(60))
        pipeline.scheduler.submit(new)
        assert renders.held.wait(60)  # the new call's first chunk is rendering (held), its tokens drawn
        time.sleep(0.1)  # the decoder runs one step ahead: let the step already in flight land
        counts = len(far.tokens), len(new.tokens)
        assert not far.lm_finished and counts[1] < 60
        time.sleep(0.3)
        assert (len(far.tokens), len(new.tokens)) == counts  # no step beside the first chunk's render
    finally:
        renders.release.set()
    assert sum(map(len, far_sink.wait(60))) == 300 * SAMPLES_PER_TOKEN
    assert sum(map(len, new_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN


def _unpaced(tokens: int, seed: int = 1) -> JobOptions:
    return dataclasses.replace(_forced(tokens, seed), paced=False)


def test_an_unpaced_job_s_chunks_are_never_deferred_on_slack(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """A job whose audio is collected whole (`paced=False`: a play-URL file, a cache prerender) has no
    listener to pace it: with a slack that would hold every later chunk of a live stream for an hour
    (its audio ahead always exceeds -3600 s), the unpaced job is still spoken to its end, chunk by chunk."""
    for lane in pipeline.scheduler.render_lanes:
        monkeypatch.setattr(lane, "defer_slack_s", -3600.0)
    sink = CollectingSink()
    job = pipeline.synthesize("A file to download.", VOICE, sink, _unpaced(150))
    assert sum(map(len, sink.wait(60))) == 150 * SAMPLES_PER_TOKEN
    assert len(job.timings.chunks) >= 3 and sum(c.tokens for c in job.timings.chunks) == 150
    assert job.pending_chunk is None  # none of its chunks was ever left waiting on slack


def test_a_live_stream_due_is_rendered_before_an_unpaced_job(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """An unpaced job fills free rows but ranks after every live stream whose chunk is due: while a later
    chunk call is held, both jobs finish decoding; every call after it holding both puts the live
    stream's chunk first (a one-row call would render it alone)."""
    for lane in pipeline.scheduler.render_lanes:
        monkeypatch.setattr(lane, "defer_slack_s", 3600.0)  # every live chunk is due (near its deadline) at once
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane == "later")
    voice = pipeline.voices.get(VOICE)
    live_sink, file_sink = CollectingSink(), CollectingSink()
    file = pipeline.make_job("A file to download.", voice, file_sink, _unpaced(200))
    live = pipeline.make_job("A live call.", voice, live_sink, _forced(200))
    done = [_wait_lm_finished(file), _wait_lm_finished(live)]
    streams: dict[int, str] = {}  # id of a job's render stream -> "file" / "live"
    _name_streams(file, "file", streams)
    _name_streams(live, "live", streams)
    try:
        pipeline.scheduler.submit(file)
        pipeline.scheduler.submit(live)
        assert renders.held.wait(60)
        assert all(event.wait(60) for event in done)
    finally:
        renders.release.set()
    assert sum(map(len, live_sink.wait(60))) == 200 * SAMPLES_PER_TOKEN
    assert sum(map(len, file_sink.wait(60))) == 200 * SAMPLES_PER_TOKEN
    later = [[streams.get(id(stream), "other") for stream, _ in items]
             for lane, items in renders.calls if lane == "later"]
    both = [names for names in later[1:] if {"live", "file"} <= set(names)]
    assert both, "after the held call, the two jobs' due chunks shared a call"
    assert all(names.index("live") < names.index("file") for names in both)


def _name_streams(job: SynthesisJob, name: str, streams: dict[int, str]) -> None:
    """Record the job's render streams (made when each segment's rendering starts; a job drops its
    stream when it ends) as `name` in `streams`, so render calls can be read by job."""
    start = job.start_rendering

    def start_and_record(planner, stream) -> None:
        streams[id(stream)] = name
        start(planner, stream)

    job.start_rendering = start_and_record


def test_an_unpaced_job_waiting_for_its_first_chunk_makes_no_stream_yield(pipeline: CosyVoice2Pipeline,
                                                                         monkeypatch) -> None:
    """Nobody hears a file's first chunk as it comes (`paced=False`): while only a file waits for its
    first chunk, a live stream far ahead of its listener keeps stepping (beside the file's steps);
    both speak all their tokens, the live stream in time."""
    launches, far, far_sink = _far_stream_recorded(pipeline, monkeypatch)
    file_sink = CollectingSink()
    file = pipeline.make_job("A file to download.", pipeline.voices.get(VOICE), file_sink, _unpaced(60))
    pipeline.scheduler.submit(file)
    assert sum(map(len, file_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN
    assert sum(map(len, far_sink.wait(60))) == 300 * SAMPLES_PER_TOKEN
    file_first = [(jobs, leads) for jobs, leads, _, unheard in launches.steps
                  if id(file) in jobs and id(file) in unheard and id(far) in leads]
    assert file_first, "the far stream was generating during the file's first-chunk steps"
    assert max(leads[id(far)] for _, leads in file_first) > YIELD_LEAD_S  # it would have yielded to a live call
    assert all(id(far) in jobs for jobs, _ in file_first)
    assert _played_in_time(far)


def test_a_file_s_decoding_is_not_paused_for_its_own_first_chunk(pipeline: CosyVoice2Pipeline,
                                                                  monkeypatch) -> None:
    """The first-chunk hold is for a caller waiting in silence: an unpaced job (a file) whose first
    chunk renders (held here) goes on decoding to its end meanwhile; a hold of a minute would
    otherwise stop it."""
    monkeypatch.setattr(pipeline.scheduler, "settings",
                        dataclasses.replace(pipeline.scheduler.settings, first_chunk_hold_s=60.0))
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane.startswith("first-"))
    sink = CollectingSink()
    try:
        file = pipeline.make_job("A file to download.", pipeline.voices.get(VOICE), sink, _unpaced(150))
        lm_done = _wait_lm_finished(file)
        pipeline.scheduler.submit(file)
        assert renders.held.wait(60)
        assert lm_done.wait(60)  # while its first chunk's render is still held
        assert sink.chunks == [] and not renders.release.is_set()
    finally:
        renders.release.set()
    assert sum(map(len, sink.wait(60))) == 150 * SAMPLES_PER_TOKEN


def test_a_file_waits_while_a_live_call_s_first_chunk_renders(pipeline: CosyVoice2Pipeline, monkeypatch) -> None:
    """A live call never waits for a file: while a new call's first chunk renders (held here) and it
    needs no step, a file still decoding takes no step beside that render; once it is out, the file
    goes on, and both speak all their tokens."""
    monkeypatch.setattr(pipeline.scheduler, "settings", dataclasses.replace(
        pipeline.scheduler.settings, yield_lead_s=0.0, first_chunk_hold_s=60.0))  # only the hold at work
    armed = threading.Event()
    renders = _HeldRenders(pipeline, monkeypatch, lambda lane: lane.startswith("first-") and armed.is_set())
    voice = pipeline.voices.get(VOICE)
    file_sink, live_sink = CollectingSink(), CollectingSink()
    file = pipeline.make_job("A file to download.", voice, file_sink, _unpaced(600))
    started = _wait_for(file, lambda j: j.timings.first_chunk is not None)
    pipeline.scheduler.submit(file)
    try:
        assert started.wait(60)
        armed.set()  # the next first chunk held is the live call's
        live = pipeline.make_job("A live call.", voice, live_sink, _forced(60))
        pipeline.scheduler.submit(live)
        assert renders.held.wait(60)
        time.sleep(0.1)  # the decoder runs one step ahead: let the step already in flight land
        counts = len(file.tokens), len(live.tokens)
        assert not file.lm_finished and counts[1] < 60
        time.sleep(0.3)
        assert (len(file.tokens), len(live.tokens)) == counts  # no step beside the live first chunk's render
    finally:
        renders.release.set()
    assert sum(map(len, live_sink.wait(60))) == 60 * SAMPLES_PER_TOKEN
    assert sum(map(len, file_sink.wait(60))) == 600 * SAMPLES_PER_TOKEN
