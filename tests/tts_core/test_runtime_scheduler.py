"""The scheduler on the tiny model: segments in order in one stream, jobs joining a running batch,
per-job failure isolation at prefill, and the timings benchmarks read."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.runtime import CollectingSink, CosyVoice2Pipeline, JobOptions, SynthesisError
from tts_core.voices import Voice

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960


@pytest.fixture(scope="module")
def pipeline(tiny_model_dir: Path):
    torch.set_num_threads(1)
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, max_batch=3, max_len=1024)
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
    assert any(step.batch == 2 for step in pipeline.scheduler.steps)


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


def test_punctuation_only_text_ends_the_stream_quietly(pipeline: CosyVoice2Pipeline) -> None:
    sink = CollectingSink()
    pipeline.synthesize("... !", VOICE, sink, _forced(30))
    assert sink.wait(30) == []


def test_scheduled_tokens_equal_the_one_request_reference(pipeline: CosyVoice2Pipeline, tiny_model_dir: Path) -> None:
    """The scheduler's loop (prefill, host sampling, stop rules, bucketed attention) draws exactly the
    tokens that the plain one-request loop `SpeechTokenLM.generate` draws with the same seed.

    Jobs run one after the other here: in a batch of several, matmul shapes change the logp by
    float rounding (~2e-6), which can flip a near-tie draw and make the sequences part ways."""
    from tts_core.llm.sampling import RasSampler
    from tts_core.model_dir import ModelDir, load_speech_lm

    md = ModelDir.open(tiny_model_dir)
    lm = load_speech_lm(md)
    lm.setup_cache(1, 1024)
    sampler = RasSampler(md.sampling, lm.speech_token_size)
    voice = pipeline.voices.get(VOICE)
    for seed, text in ((5, "Hi there."), (6, "Good morning to you.")):
        sink = CollectingSink()
        job = pipeline.synthesize(text, VOICE, sink, JobOptions(seed=seed))
        sink.wait(120)
        (text_tokens,) = job.segments
        expected = list(lm.generate(text_tokens, sampler, torch.Generator().manual_seed(seed), voice.prompt_text,
                                    voice.llm_prompt_speech_token))
        assert job.tokens == expected
