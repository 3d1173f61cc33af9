"""CosyVoice3 served by the batched runtime (scheduler, render lanes, DiT chunk renderer) on the tiny
golden model: its streamed audio equals the official streaming output (the final chunk chunk-masked
by default, the official full-attention re-render on request), instructs reach the LM as the
official instruct2 prompt and never the spoken text, and silent runs are cut before the flow.

Tolerances: the mel to 1e-4 (measured ~1.2e-6: the pooled DiT attends over [kept keys | new keys]
where the re-render attends over all frames at once, so float32 rounds differently); the waveform to
a mean, because this random tiny HiFT is ~1e4 times as sensitive as its input (a 1e-6 mel
difference moves single samples by up to ~5e-2, no voicing flips). A seam or an off-by-one offset
would move whole chunks by the signal's own level (~1e-1 mean).
"""

from __future__ import annotations

import sys

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.runtime import CollectingSink, CosyVoice2Pipeline, JobOptions, SynthesisJob
from tts_core.runtime.chunk_render import FlowPoolSettings
from tts_core.runtime.dit_render import DiTChunkRenderer
from tts_core.runtime.family import COSYVOICE3
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule
from tts_core.streaming.token2wav3 import Token2Wav3Stream
from tts_core.text.cosyvoice3 import DIALECTS, INSTRUCT_TEXTS, INSTRUCTS
from tts_core.voices import VoiceBank

WAV_MEAN_TOL = 2e-4
MEL_TOL = 1e-4
VOICE = "golden_speaker"


@pytest.fixture(scope="module")
def stream_case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "token2wav_stream.pt", weights_only=False)


@pytest.fixture(scope="module")
def schedule(golden3_dir: Path) -> ChunkSchedule:
    """The official streaming schedule, from the golden flow case (hop, max hop, growth)."""
    flow_case = torch.load(golden3_dir / "cases" / "flow.pt", weights_only=False)
    return ChunkSchedule(hop_tokens=flow_case["hop"], max_hop_tokens=flow_case["max_hop"],
                         hop_scale=flow_case["stream_scale_factor"], lookahead_tokens=flow_case["pre_lookahead_len"])


@pytest.fixture(scope="module")
def pipeline(tiny3_model_dir: Path, schedule: ChunkSchedule):
    torch.set_num_threads(1)
    pipeline = CosyVoice2Pipeline.load(tiny3_model_dir, max_batch=3, max_len=1024, schedule=schedule)
    yield pipeline
    pipeline.close()


def _close(ours: np.ndarray, official: torch.Tensor) -> None:
    assert np.abs(ours - official.reshape(-1).numpy()).mean() <= WAV_MEAN_TOL


def _reference(scheduler, voice, chunk_masked_final: bool) -> Token2Wav3Stream:
    return Token2Wav3Stream(scheduler.flow, scheduler.hift, torch.tensor([voice.flow_prompt_speech_token]),
                            voice.prompt_speech_feat[None], voice.flow_embedding[None],
                            chunk_masked_final=chunk_masked_final)


def test_the_family_is_read_from_the_directory(pipeline: CosyVoice2Pipeline) -> None:
    assert pipeline.family is COSYVOICE3
    assert isinstance(pipeline.scheduler.renderer, DiTChunkRenderer)


def _golden_stream(pipeline: CosyVoice2Pipeline, stream_case: dict, schedule: ChunkSchedule,
                   official_final: bool) -> tuple[DiTChunkRenderer, object, list]:
    scheduler = pipeline.scheduler
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift,
                                FlowPoolSettings(stream_slots=1, official_final=official_final))
    voice = pipeline.voices.get(VOICE)
    stream = renderer.stream(voice, schedule, None)
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    tokens = stream_case["tokens"][0].tolist()
    chunks = []
    while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
        chunks.extend(renderer.render([(stream, tokens, task)]))
    return renderer, stream, chunks


def test_the_runtime_renderer_streams_the_official_chunks(pipeline: CosyVoice2Pipeline, stream_case: dict,
                                                          golden3_dir: Path, schedule: ChunkSchedule) -> None:
    """With `official_final`, the render lanes' CosyVoice3 renderer, fed the golden tokens on the official
    schedule, yields the official `tts(stream=True)` chunks, chunk by chunk: each chunk's mel equals the
    official flow call's new frames (the streaming ones from the pool, the final one re-rendered) and its
    waveform the official one (its own slots, not the lanes')."""
    renderer, stream, chunks = _golden_stream(pipeline, stream_case, schedule, official_final=True)
    calls = torch.load(golden3_dir / "cases" / "flow.pt", weights_only=False)["stream_calls"]
    assert len(chunks) == len(stream_case["chunks"]) == len(calls)
    for ours, official, call in zip(chunks, stream_case["chunks"], calls, strict=True):
        assert ours.mel.shape == call["mel_new"].shape
        assert (ours.mel - call["mel_new"]).abs().max().item() <= MEL_TOL
        assert ours.audio.size == official.size(1)
        _close(ours.audio, official)
    assert stream.finished
    assert renderer.slots.take() == stream.slot  # the final chunk gave its slot back


def test_golden_final_chunk_is_chunk_masked_by_default_within_the_stated_deviation_from_the_official(
        pipeline: CosyVoice2Pipeline, stream_case: dict, golden3_dir: Path, schedule: ChunkSchedule) -> None:
    """By default the final chunk comes from the pool too, chunk-masked: the golden streaming chunks then
    equal the one chunk-masked render of all tokens (`mel_stream_full`), and the final chunk differs from
    the official full-attention one by what docs/PERF_NOTES.md states (golden: max 0.043, mean 0.011
    against a mel level of 1.12 mean abs: 3.8 % / 1.0 %; held to CosyVoice2's 20 % / 2 %), not by nothing.
    The stream kept its non-final frames past the voice's shared ones, none of the final chunk's."""
    renderer, stream, chunks = _golden_stream(pipeline, stream_case, schedule, official_final=False)
    case = torch.load(golden3_dir / "cases" / "flow.pt", weights_only=False)
    mel = torch.cat([c.mel for c in chunks], dim=2)
    assert (mel - case["mel_stream_full"]).abs().max().item() <= MEL_TOL
    official = case["stream_calls"][-1]["mel_new"]
    diff = (chunks[-1].mel - official).abs()
    level = official.abs().mean().item()
    assert MEL_TOL < diff.max().item() <= 0.2 * level and diff.mean().item() <= 0.02 * level
    assert [c.audio.size for c in chunks] == [c.size(1) for c in stream_case["chunks"]]
    for ours, official in zip(chunks[:-1], stream_case["chunks"][:-1]):
        _close(ours.audio, official)
    prompt, shared = stream.prompt.feat.size(1), renderer.pool.voice_of[stream.slot].frames
    final = chunks[-1].mel.size(2)
    assert stream.finished and renderer.pool.own[stream.slot] == prompt + mel.size(2) - final - shared


def test_a_voice_the_pool_cannot_hold_still_streams_the_same_chunks(pipeline: CosyVoice2Pipeline, stream_case: dict,
                                                                     schedule: ChunkSchedule) -> None:
    """With no room for the voice's shared prompt frames, each stream renders the prompt into its own slot:
    the same chunks (mel to 1e-4) as with them shared."""
    scheduler = pipeline.scheduler
    shared = _golden_stream(pipeline, stream_case, schedule, official_final=False)[2]
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift, FlowPoolSettings(stream_slots=1, voice_frames=0))
    voice = pipeline.voices.get(VOICE)
    stream = renderer.stream(voice, schedule, None)
    assert renderer.pool.voice_of[stream.slot].frames == 0
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    tokens = stream_case["tokens"][0].tolist()
    alone = []
    while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
        alone.extend(renderer.render([(stream, tokens, task)]))
    assert [c.mel.shape for c in alone] == [c.mel.shape for c in shared]
    for ours, reference in zip(alone, shared):
        assert (ours.mel - reference.mel).abs().max().item() <= MEL_TOL


@pytest.mark.parametrize("official_final", [False, True], ids=["chunk_masked_final", "official_final"])
def test_streams_rendered_in_one_batched_call_each_get_their_own_official_chunks(
        pipeline: CosyVoice2Pipeline, stream_case: dict, schedule: ChunkSchedule, official_final: bool) -> None:
    """Three streams of different lengths, their due chunks rendered together each round (one pooled DiT
    solve with rows of different lengths and contexts; with `official_final` one more padded full
    re-render for the final ones): each stream's mel equals what the official streaming path (the
    reference; its final chunk chunk-masked unless `official_final`) makes of its tokens alone, and its
    chunks have the official lengths."""
    scheduler = pipeline.scheduler
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift,
                                FlowPoolSettings(stream_slots=3, official_final=official_final))
    voice = pipeline.voices.get(VOICE)
    golden = stream_case["tokens"][0].tolist()
    token_lists = [golden, golden[:61], golden[7:40]]
    streams = [renderer.stream(voice, schedule, None) for _ in token_lists]
    planners = [ChunkPlanner(schedule, len(voice.flow_prompt_speech_token)) for _ in token_lists]
    got: list[list] = [[] for _ in token_lists]
    while due := [(i, task) for i, (planner, tokens) in enumerate(zip(planners, token_lists))
                  if (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None]:
        out = renderer.render([(streams[i], token_lists[i], task) for i, task in due])
        for (i, _), chunk in zip(due, out):
            got[i].append(chunk)
    assert sum(len(g) for g in got) >= 6 and max(len(g) for g in got) == 3
    for tokens, chunks in zip(token_lists, got):
        reference = _reference(scheduler, voice, chunk_masked_final=not official_final)
        planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
        expected = []
        while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
            expected.append(reference.render(tokens, task))
        assert [c.audio.size for c in chunks] == [e.size(1) for e in expected]
        mel = torch.cat([c.mel for c in chunks], dim=2)
        assert (mel - reference.mel).abs().max().item() <= MEL_TOL
        ours, official = np.concatenate([c.audio for c in chunks]), torch.cat(expected, dim=1)[0].numpy()
        assert np.abs(ours - official).mean() <= WAV_MEAN_TOL


def test_the_engine_streams_what_the_official_streaming_path_makes_of_its_tokens(
        pipeline: CosyVoice2Pipeline, schedule: ChunkSchedule) -> None:
    """End to end through the scheduler (LM decode, silent-run filter, render lanes): the streamed
    chunks equal the official token2wav streaming (Token2Wav3Stream, itself checked against the
    golden chunks; its final chunk chunk-masked, the runtime's default) over the tokens the LM drew,
    one chunk for each official call."""
    sink = CollectingSink()
    job = pipeline.synthesize("Hello there, how are you today?", VOICE, sink, JobOptions(seed=1, min_tokens=140,
                                                                                         max_tokens=140))
    sink.wait(60)
    scheduler = pipeline.scheduler
    voice = pipeline.voices.get(VOICE)
    reference = _reference(scheduler, voice, chunk_masked_final=True)
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    expected = []
    while (task := planner.next_chunk(len(job.flow_tokens), lm_finished=True)) is not None:
        expected.append(reference.render(job.flow_tokens, task))
    assert len(job.tokens) == 140
    assert len(sink.chunks) == len(expected) >= 3
    for ours, official in zip(sink.chunks, expected, strict=True):
        assert ours.size == official.size(1)
        _close(ours, official)


def test_the_compile_thread_finds_nothing_to_compile_in_the_dit_renderer(pipeline: CosyVoice2Pipeline) -> None:
    """The tts-compile thread asks the renderer for its compiled graphs after the LM's: without captured DiT
    graphs (here, on the CPU) there is nothing to record again, and it says so instead of failing that thread."""
    assert pipeline.scheduler.renderer.capture_compiled(lambda: False) == {}


def test_instructs_are_the_authors_list_by_name(pipeline: CosyVoice2Pipeline, golden3_dir: Path) -> None:
    tokenizer_case = __import__("json").loads((golden3_dir / "cases" / "tokenizer.json").read_text())
    assert list(DIALECTS.values()) + list(INSTRUCTS.values()) == list(INSTRUCT_TEXTS) == tokenizer_case["instruct_list"]
    assert pipeline.instruct_tokens(None, "cantonese") == tuple(tokenizer_case["instruct_list_ids"][0])
    with pytest.raises(ValueError, match="dialect: 'klingon' is not one of cantonese"):
        pipeline.instruct_tokens(None, "klingon")
    with pytest.raises(ValueError, match="give one"):
        pipeline.instruct_tokens("happy", "sichuan")


def test_an_instruct_is_the_lm_prompt_never_the_spoken_text(pipeline: CosyVoice2Pipeline, golden3_dir: Path) -> None:
    """An instruct request's prefill is the official instruct2 input ([sos, embed(instruct ++ text),
    task_id], no prompt speech), and the text the job speaks holds none of the instruct's tokens."""
    case = torch.load(golden3_dir / "cases" / "llm.pt", weights_only=False)
    instruct = pipeline.instruct_tokens(None, "cantonese")  # instruct_list[0], as the golden case used
    assert instruct == tuple(case["instruct"]["prompt_text_token"][0].tolist())
    text = case["text_token"][0].tolist()
    job = SynthesisJob("text", [text], pipeline.voices.get(VOICE), CollectingSink(),
                       JobOptions(instruct_tokens=instruct))
    prompt_text, prompt_speech = job.lm_prompt()
    lm_input = pipeline.scheduler.lm.build_prefill_input(job.segments[0], prompt_text, prompt_speech)
    assert (lm_input - case["instruct"]["lm_input"][0]).abs().max().item() <= 1e-6
    endofprompt = pipeline.frontend.tokenizer.token_id("<|endofprompt|>")
    spoken = pipeline.make_job("请用广东话表达。 Hello!", pipeline.voices.get(VOICE), CollectingSink()).segments
    assert instruct[-1] == endofprompt and all(endofprompt not in segment for segment in spoken)


def test_an_instruct_request_streams_audio(pipeline: CosyVoice2Pipeline) -> None:
    sink = CollectingSink()
    pipeline.synthesize("Good morning.", VOICE, sink, JobOptions(seed=2, min_tokens=40, max_tokens=40,
                                                                 instruct_tokens=pipeline.instruct_tokens("happy", None)))
    audio = np.concatenate(sink.wait(60))
    assert audio.size == 40 * 960 and np.isfinite(audio).all() and np.abs(audio).max() > 0


def test_silent_runs_beyond_five_never_reach_the_flow(pipeline: CosyVoice2Pipeline, golden3_dir: Path) -> None:
    """The official llm_job's cap, applied between the LM and the flow: the job's flow tokens are
    exactly what the official passed on for the golden silent script; the LM history keeps them all."""
    case = torch.load(golden3_dir / "cases" / "llm.pt", weights_only=False)
    job = SynthesisJob("text", [[1, 2]], pipeline.voices.get(VOICE), CollectingSink())
    job.start_segment(0, 1000, COSYVOICE3.token_filter())
    for token in case["silent_script"]:
        job.accept_token(int(token), pipeline.scheduler.lm.speech_token_size)
    assert job.flow_tokens == [int(t) for t in case["silent_kept"]]
    assert job.tokens == [int(t) for t in case["silent_script"]]


def test_a_voice_without_the_system_prefix_is_refused_at_load(tiny3_model_dir: Path, tmp_path: Path) -> None:
    voice = VoiceBank.load(tiny3_model_dir).get(VOICE)
    entry = voice.to_spk2info()
    entry["prompt_text"] = entry["prompt_text"][:, -5:]  # the transcript only, <|endofprompt|> cut off
    entry["prompt_text_len"] = torch.tensor([5], dtype=torch.int32)
    (tmp_path / "voices").mkdir()
    torch.save({"bare": entry}, tmp_path / "voices" / "bare.pt")
    with pytest.raises(ValueError, match="voice 'bare' of .*<\\|endofprompt\\|>"):
        CosyVoice2Pipeline.load(tiny3_model_dir, voices_dir=tmp_path / "voices", max_batch=1, max_len=512)


@pytest.fixture()
def two_streams(pipeline: CosyVoice2Pipeline, stream_case: dict, schedule: ChunkSchedule):
    """A renderer of its own with two open streams of the golden voice, the golden tokens and their first chunk."""
    scheduler = pipeline.scheduler
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift, FlowPoolSettings(stream_slots=2))
    voice = pipeline.voices.get(VOICE)
    tokens = stream_case["tokens"][0].tolist()
    task = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token)).next_chunk(len(tokens), lm_finished=False)
    return renderer, tokens, task, renderer.stream(voice, schedule, None), renderer.stream(voice, schedule, None)


@contextmanager
def vocoder_hook(renderer: DiTChunkRenderer, before) -> Iterator[None]:
    """`before(mel)` runs at each vocoder call of the renderer (what another thread, or a fault, does then)."""
    decode = renderer.hift.decode

    def hooked(mel, source, finalize):
        before(mel)
        return decode(mel, source, finalize)

    renderer.hift.decode = hooked
    try:
        yield
    finally:
        del renderer.hift.decode


def test_a_stream_closed_while_rendering_frees_its_slot_once_and_a_closed_one_is_not_rendered(two_streams) -> None:
    """A cancelled job's stream is closed by the decode thread, perhaps while a lane renders its chunk: the
    slot comes back when that render ends (not before, or a new stream could take it mid-render), once."""
    renderer, tokens, task, stream, other = two_streams

    def closing_midway(mel):  # the decode thread's close, landing during the render
        stream.close()
        assert stream.slot not in renderer.slots._free

    with vocoder_hook(renderer, closing_midway):
        (chunk,) = renderer.render([(stream, tokens, task)])
    assert chunk.audio.size > 0 and renderer.slots._free == [stream.slot]
    stream.close()  # again: nothing more is given back
    assert renderer.slots._free == [stream.slot]
    (skipped,) = renderer.render([(stream, tokens, task)])  # closed before its render: not rendered
    assert skipped.audio.size == 0 and renderer.slots._free == [stream.slot] and not other.closed


def test_a_failed_render_call_leaves_every_stream_as_it_was(two_streams, stream_case: dict,
                                                             schedule: ChunkSchedule) -> None:
    """The render loop renders a failed call's chunks again one by one (so one bad job fails alone): the
    vocoder failing in the call (its one batched decode of both streams' equal windows, after their F0 and
    phase increments were worked out) must not have moved the first on, or its retry would repeat audio."""
    renderer, tokens, task, first, second = two_streams
    rows = []

    def failing(mel):
        rows.append(mel.size(0))
        raise RuntimeError("vocoder failed")

    with vocoder_hook(renderer, failing), pytest.raises(RuntimeError, match="vocoder failed"):
        renderer.render([(first, tokens, task), (second, tokens, task)])
    assert rows == [2]
    (again,) = renderer.render([(first, tokens, task)])  # the retry, alone
    _close(again.audio, stream_case["chunks"][0])
    assert renderer.slots.frames[first.slot] == 2 * task.token_end - 2 * schedule.lookahead_tokens


def test_the_vocoder_windows_listed_for_graphs_are_those_a_long_segment_decodes(
        pipeline: CosyVoice2Pipeline, schedule: ChunkSchedule) -> None:
    """`vocoder_windows` (what each lane's vocoder graphs are captured for) lists every non-final decoder
    window a segment decodes, through the hop's growth to its steady size, and nothing it does not."""
    scheduler = pipeline.scheduler
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift, FlowPoolSettings(stream_slots=1))
    voice = pipeline.voices.get(VOICE)
    listed = renderer.vocoder_windows(schedule, [voice])
    stream = renderer.stream(voice, schedule, None)
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    gen = torch.Generator().manual_seed(3)
    # the hop's growth to max_hop, then two chunks at it and a final one
    tokens = planner.tokens_needed() + 2 * schedule.hop_tokens + 4 * schedule.max_hop_tokens
    tokens = torch.randint(0, scheduler.flow.cfg.vocab_size, (tokens,), generator=gen).tolist()
    decoded = []

    def before(mel):
        decoded.append(mel.size(2))

    with vocoder_hook(renderer, before):
        while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
            renderer.render([(stream, tokens, task)])
            if task.finalize:
                decoded.pop()
    assert sorted(set(decoded)) == listed.chunks
    assert len(decoded) > len(listed.chunks)  # the steady window repeats


def test_the_final_vocoder_windows_listed_for_graphs_are_those_segments_of_any_length_end_with(
        pipeline: CosyVoice2Pipeline, schedule: ChunkSchedule) -> None:
    """`vocoder_windows`' final windows: segments that end at token counts spread from one token through the
    hop's growth to its steady size (the LM may stop anywhere; the counts at each hop's edges included) end on
    a window listed for the lane that renders that final chunk: the first lanes' when it is the segment's
    first, else the later lane's (but for windows too short to capture: a token or two, decoded eagerly)."""
    scheduler = pipeline.scheduler
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift, FlowPoolSettings(stream_slots=1))
    voice = pipeline.voices.get(VOICE)
    listed = renderer.vocoder_windows(schedule, [voice])
    prompt_tokens = len(voice.flow_prompt_speech_token)
    planner = ChunkPlanner(schedule, prompt_tokens)
    edges = []  # where the final chunk's kind or length range changes: each non-final chunk's token_end
    for _ in range(5):
        edges.append(planner.tokens_needed())
        planner.next_chunk(sys.maxsize, lm_finished=False)
    lengths = sorted({1, *range(2, edges[-1] + 2, 17)} | {e + d for e in edges for d in (-1, 0, 1)})
    tokens = torch.randint(0, scheduler.flow.cfg.vocab_size, (max(lengths),),
                           generator=torch.Generator().manual_seed(4)).tolist()
    seen = {"first": set(), "later": set()}
    for length in lengths:
        planner = ChunkPlanner(schedule, prompt_tokens)
        stream = renderer.stream(voice, schedule, None)
        decoded = []
        with vocoder_hook(renderer, lambda mel: decoded.append(mel.size(2))):
            chunks = 0
            while (task := planner.next_chunk(length, lm_finished=True)) is not None:
                renderer.render([(stream, tokens[:length], task)])
                chunks += 1
        kind = "first" if chunks == 1 else "later"
        if decoded[-1] <= scheduler.hift.conv_pre_look_right + 1:
            assert length <= 2
            continue
        assert decoded[-1] in (listed.first_finals if kind == "first" else listed.later_finals), (length, kind)
        seen[kind].add(decoded[-1])
    assert seen["first"] and len(seen["later"]) > 3


@pytest.mark.parametrize("first_hop", [None, 7], ids=["official_schedule", "first_hop_off_the_chunk_grid"])
def test_every_dit_call_of_a_long_segment_fits_a_captured_solve_bucket(
        pipeline: CosyVoice2Pipeline, schedule: ChunkSchedule, first_hop: int | None) -> None:
    """`solve_buckets` (what each lane's DiT solve graphs are captured for): every call of a segment long
    enough to slide past its kept window, through the hop's growth and its final chunk, fits a bucket of
    its lane kind (a first chunk the first lanes', the rest the later lane's), so none runs eagerly."""
    scheduler = pipeline.scheduler
    chunk = scheduler.flow.cfg.estimator.static_chunk_size
    renderer = DiTChunkRenderer(scheduler.flow, scheduler.hift, FlowPoolSettings(stream_slots=1,
                                                                                 context_frames=3 * chunk))
    schedule = ChunkSchedule(schedule.hop_tokens, schedule.max_hop_tokens, schedule.hop_scale,
                             schedule.lookahead_tokens, first_hop)
    voice = pipeline.voices.get(VOICE)
    stream = renderer.stream(voice, schedule, None)
    buckets = renderer.solve_buckets(schedule)
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    tokens = planner.tokens_needed() + 3 * schedule.hop_tokens + 6 * schedule.max_hop_tokens + 5
    tokens = torch.randint(0, scheduler.flow.cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(4))
    tokens = tokens.tolist()
    calls = []
    while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
        end = renderer._condition(stream, tokens, task).mu.size(2)
        row = renderer.pool.row(stream.slot, end, keep=not task.finalize)
        calls.append((task.index, len(row.context), row.end - row.start))
        renderer.pool.advance(stream.slot, row)
    assert any(renderer.pool.slid) and calls[-1][0] >= 4  # slid past its window, through the hop's growth
    for index, ctx, new in calls:
        ctx_caps, new_caps = buckets["first" if index == 0 else "later"]
        assert ctx <= max(ctx_caps) and new <= max(new_caps), (index, ctx, new, buckets)
