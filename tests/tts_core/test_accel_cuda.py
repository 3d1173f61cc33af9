"""GPU runners of tts_core.accel on the tiny golden model: replay equals the eager module calls.
Skipped where no CUDA device is present (CI); the full-size timings come from the GPU benchmarks in bench/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_prefill_input_is_built_without_waiting_for_the_work_queued_on_the_stream(tiny_model_dir: Path) -> None:
    """The decode thread builds a new call's LM input while earlier prefills still run on the
    prefill stream: the ids' copy must queue behind them, not make the host wait for them (a
    pageable copy synchronizes the stream, and the decode steps stopped meanwhile)."""
    from tts_core.host_copy import to_device
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    text, prompt_text, prompt_speech = [5, 6, 7], (1, 2), (3, 4, 5, 6)
    expected = lm.build_prefill_input(text, prompt_text, prompt_speech)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued ahead
        got = lm.build_prefill_input(text, prompt_text, prompt_speech)
        slots = to_device([3, 1], torch.long, torch.device("cuda"))
        assert not stream.query()  # the host did not wait for the queued work
    stream.synchronize()
    assert torch.equal(got, expected) and slots.tolist() == [3, 1]


def test_a_graph_is_uploaded_where_it_is_captured_and_replays_the_same() -> None:
    """graph_capture.upload: the first replay while serving does not pay the upload (~0.85 us a node on an H200);
    an uploaded graph's replay computes what the call computes."""
    from tts_core.accel.graph_capture import capture_graph, upload

    x = torch.arange(8, dtype=torch.float32, device="cuda")
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    out = capture_graph(graph, lambda: (x * 2 + 1).cumsum(0), warmup=1, stream=stream)
    assert upload(graph, stream) == hasattr(graph, "raw_cuda_graph_exec")
    x.copy_(torch.arange(8, 16, dtype=torch.float32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (x * 2 + 1).cumsum(0))


def test_graphed_decode_steps_equal_eager_steps(tiny_model_dir: Path) -> None:
    from tts_core.accel.batched_sampler import BatchedRasSampler
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.llm.sampling import SamplingConfig
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    cache = lm.setup_cache(9, 96)
    live = [3, 0, 5]
    gen = torch.Generator().manual_seed(0)
    inputs = [lm.build_prefill_input(torch.randint(0, 100, (5 + 3 * i,), generator=gen).tolist()) for i in live]
    lm.prefill(live, inputs)
    snap = cache.snapshot()
    tokens = torch.randint(0, lm.speech_token_size, (3, len(live)), generator=gen)
    eager = [lm.decode_step(live, t.tolist()).clone() for t in tokens]
    dec = GraphedDecoder(lm, BatchedRasSampler(SamplingConfig(), lm.speech_token_size), (1, 2, 4, 8), (32, 96))
    cache.restore(snap)
    for t, expected in zip(tokens, eager):
        kv = int(cache.lengths[live].max())
        got = dec.step(live, t.tolist(), kv_len=kv)
        assert torch.allclose(got, expected, atol=1e-4)
    assert int(cache.lengths[dec.scratch_slot]) <= 8  # padding never runs the scratch row off the cache


def test_compiled_decode_graphs_captured_beside_the_eager_ones_are_swapped_in_at_a_step(tiny_model_dir: Path) -> None:
    """The runtime's start-up order: eager-module graphs first, the compiled set captured on another
    thread (touching only the scratch slot) and taken at the next step; both steps equal eager."""
    import threading

    from tts_core.accel.batched_sampler import BatchedRasSampler
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.llm.sampling import SamplingConfig
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    cache = lm.setup_cache(9, 96)
    live = [3, 0, 5]
    gen = torch.Generator().manual_seed(0)
    lm.prefill(live, [lm.build_prefill_input(torch.randint(0, 100, (5 + 3 * i,), generator=gen).tolist())
                      for i in live])
    snap = cache.snapshot()
    tokens = torch.randint(0, lm.speech_token_size, (2, len(live)), generator=gen)
    eager = [lm.decode_step(live, t.tolist()).clone() for t in tokens]
    cache.restore(snap)
    dec = GraphedDecoder(lm, BatchedRasSampler(SamplingConfig(), lm.speech_token_size), (1, 2, 4, 8), (32, 96),
                         compile=False)
    assert not dec.compiled
    got = dec.step(live, tokens[0].tolist(), kv_len=int(cache.lengths[live].max()))
    assert torch.allclose(got, eager[0], atol=1e-4)
    worker = threading.Thread(target=dec.capture_compiled)
    worker.start()
    worker.join()
    assert not dec.compiled  # published, not yet taken: the decode thread's next step takes it
    got = dec.step(live, tokens[1].tolist(), kv_len=int(cache.lengths[live].max()))
    assert dec.compiled and torch.allclose(got, eager[1], atol=1e-4)
    assert cache.lengths[live].tolist() == (snap[2][live] + 2).tolist()  # live rows: only their own two steps


def test_graphed_steps_draw_what_the_eager_decoder_draws_and_overlap_changes_nothing(
        tiny_model_dir: Path) -> None:
    """The graphed decoder against the eager carried decoder (the CPU path) from the same cache and
    generator seed, one bucket that fits the rows exactly (no padding rows, the eager step's attend
    width); then the graphed steps read one step behind (launch k+1 before reading k, as the
    scheduler does): the same tokens each time."""
    from tts_core.accel.batched_sampler import BatchedRasSampler
    from tts_core.accel.carried_decode import EagerCarriedDecoder
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.llm.sampling import SamplingConfig
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    cache = lm.setup_cache(9, 128)
    live = [3, 0, 5]
    gen = torch.Generator().manual_seed(2)
    lm.prefill(live, [lm.build_prefill_input(torch.randint(0, 100, (5 + 3 * i,), generator=gen).tolist())
                      for i in range(3)])
    snap = cache.snapshot()
    sampler = BatchedRasSampler(SamplingConfig(), lm.speech_token_size)
    first = [[7], [8, 9], [10]]
    eager = EagerCarriedDecoder(lm, sampler)
    graphed = GraphedDecoder(lm, sampler, (3,), (cache.attend_len(40),), compile=False, slot_attention=False)

    def run(decoder, behind: bool) -> list[list[int]]:
        cache.restore(snap)
        decoder.generator.manual_seed(5)
        decoder.seed(live, first)
        rows = [list(t) for t in first]
        pending = None
        for _ in range(10):
            launched = decoder.launch(live, [True] * 3, kv_len=40)
            if behind:
                pending, launched = launched, pending
            if launched is not None:
                for r, t in zip(rows, launched.result()):
                    r.append(t)
        if pending is not None:
            for r, t in zip(rows, pending.result()):
                r.append(t)
        return rows

    want = run(eager, behind=False)
    assert run(graphed, behind=False) == want
    assert run(graphed, behind=True) == want


def test_the_graphed_scheduler_speaks_every_forced_token_with_prefills_on_their_own_stream(
        tiny_model_dir: Path) -> None:
    """The whole GPU path as the gateway runs it (graphs, carried overlapped decode, prefills and
    first draws on their own stream, two first lanes):
    three calls of different lengths in one batch each get exactly their forced tokens' audio, and
    no stop token reaches a call."""
    from tts_core.runtime import (
        CollectingSink,
        CosyVoice2Pipeline,
        JobOptions,
        SchedulerSettings,
    )

    # normalize=False: the GPU path is under test, and the lent GPU hosts have no wetext wheel
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, "cuda", torch.float32, max_batch=3, max_len=1024,
                                       fast=SchedulerSettings(graphs=True, compile_flow=False, first_chunk_lanes=2),
                                       normalize=False)
    try:
        scheduler = pipeline.scheduler
        assert scheduler.settings.decode_steps_ahead >= 1
        scheduler.renderer.time_gpu = True  # the benchmarks' vocoder timing changes nothing it times
        steps = []
        scheduler.on_step = steps.append
        counts = [60, 130, 250]
        sinks = [CollectingSink() for _ in counts]
        jobs = [pipeline.synthesize("Thank you for calling.", "golden_speaker", sink,
                                    JobOptions(seed=i, min_tokens=n, max_tokens=n))
                for i, (sink, n) in enumerate(zip(sinks, counts))]
        for sink, n in zip(sinks, counts):
            assert sum(map(len, sink.wait(180))) == n * 960  # 960 samples per token at 24 kHz
        assert scheduler.runner._prefill_stream is not None
        assert any(step.batch >= 2 for step in steps)
        assert all(t < scheduler.lm.speech_token_size for job in jobs for t in job.tokens)
        assert all(c.hift_gpu_s is not None and min(c.hift_gpu_s) > 0 for job in jobs for c in job.timings.chunks)
    finally:
        pipeline.close()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 matmuls need compute capability 8.9+")
def test_compiled_fp8_decode_steps_equal_eager_fp8_steps(tiny_model_dir: Path) -> None:
    from tts_core.accel.batched_sampler import BatchedRasSampler
    from tts_core.accel.fp8_linear import use_fp8_projections
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.llm.sampling import SamplingConfig
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.bfloat16)
    use_fp8_projections(lm)
    cache = lm.setup_cache(5, 64)
    live = [2, 0]
    gen = torch.Generator().manual_seed(1)
    lm.prefill(live, [lm.build_prefill_input(torch.randint(0, 100, (6 + i,), generator=gen).tolist()) for i in live])
    snap = cache.snapshot()
    tokens = torch.randint(0, lm.speech_token_size, (3, len(live)), generator=gen)
    eager = [lm.decode_step(live, t.tolist()).clone() for t in tokens]
    # compiled: inductor lowers _scaled_mm itself
    dec = GraphedDecoder(lm, BatchedRasSampler(SamplingConfig(), lm.speech_token_size), (1, 2, 4), (64,))
    cache.restore(snap)
    for t, expected in zip(tokens, eager):
        got = dec.step(live, t.tolist(), kv_len=int(cache.lengths[live].max()))
        assert torch.isfinite(got).all()
        assert float((got - expected).norm() / expected.norm()) < 2e-2


def _golden_pool_graphs(tiny_model_dir: Path, golden_dir: Path, monkeypatch, compiled: bool) -> tuple:
    """The tiny flow in float32 on the GPU, the golden flow case, a pool with the golden voice
    registered, and (uncaptured) graphs for it: (flow, case, pooled, voice, graphs)."""
    from tts_core.accel.flow_pool_graphs import PooledFlowGraphs, compiled_estimator
    from tts_core.flow import load_flow
    from tts_core.flow.context_pool import PoolShape
    from tts_core.flow.pooled import PooledFlow

    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions, as the golden run
    flow = load_flow(tiny_model_dir, "cuda", torch.float32)
    case = torch.load(golden_dir / "cases" / "flow.pt", weights_only=False)
    speaker = next(iter(torch.load(tiny_model_dir / "spk2info.pt", weights_only=False).values()))
    pooled = PooledFlow(flow, PoolShape(stream_slots=4, stream_frames=400, voice_slots=1, voice_frames=100,
                                        prompt_frames=200))
    voice = pooled.register_voice(*(speaker[k].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                                  "flow_embedding")))
    graphs = PooledFlowGraphs(pooled, compiled_estimator(flow.decoder.estimator) if compiled else None)
    return flow, case, pooled, voice, graphs


@pytest.mark.parametrize(("compiled", "parts"), [(False, 1), (True, 1), (False, 3), (True, 10)],
                         ids=["eager-step", "compiled-step", "eager-step-3-parts", "compiled-step-10-parts"])
def test_pooled_flow_graphs_equal_the_golden_streaming_calls(tiny_model_dir: Path, golden_dir: Path,
                                                             monkeypatch, compiled: bool, parts: int) -> None:
    # A solve cut into parts (one graph each, launched two ahead of the GPU) must give what one
    # graph gives: each part reads the state the part before it left in the graphs' shared pool.
    _, case, pooled, voice, graphs = _golden_pool_graphs(tiny_model_dir, golden_dir, monkeypatch, compiled)
    graphs.capture(rows=(1, 4), ctx_caps=(50, 150, 250), new_caps=(112,), parts=parts)
    assert {len(g.graphs) for g in graphs.solve_graphs.values()} == {parts}
    streams = [pooled.open_stream(voice) for _ in range(3)]
    first = case["first_hop"] + case["pre_lookahead_len"]
    done = 0
    graphs.time_gpu = True  # the benchmarks' encoder/solve split changes nothing it times
    for key, n, finalize in (("mel_stream_first", first, False), ("mel_stream_second", first + case["hop"], False),
                             ("mel_stream_final", case["tokens"].size(1), True)):
        # The encoder of this call's shape captured for one row only (as final calls are at
        # start-up): the three streams' call replays it three times.
        plan = pooled.plan(streams[0], case["tokens"][:, :n].cuda(), finalize)
        graphs.capture_encoder((1,), plan.enc_tokens.size(1), plan.new_frames, finalize)
        outs = graphs.render(streams, [case["tokens"][:, :n].cuda()] * 3, [finalize] * 3)
        for out in outs:
            assert (out.cpu() - case[key][:, :, done:]).abs().max().item() <= 1e-4, key
        encoder_s, solve_s = graphs.gpu_split()
        assert 0 < encoder_s and 0 < solve_s
        done = case[key].size(2)
    assert graphs.eager_calls == 0  # every call found a captured bucket (3 rows padded into 4)
    assert graphs.eager_encodes == 0  # and every encoder a graph, replayed row by row


@pytest.mark.parametrize("compiled", [False, True], ids=["plain", "compiled-stages"])
def test_graphed_hift_equals_the_eager_decode_of_its_own_source(tiny_model_dir: Path, compiled: bool) -> None:
    """A HiFT graph (first chunk: no cache; later chunk: cached source samples), plain or with the
    stages compiled (compile_hift), gives each row what the eager vocoder gives for the mel and the
    excitation the graph drew, within the float32 spread of that very input (see
    test_golden_hift.float32_tolerance: ~30 layers ahead of a clipped exp)."""
    import copy

    from tts_core.accel.hift_graphs import GraphedHift, compiled_mix
    from tts_core.hift import load_hift

    vocoder = load_hift(tiny_model_dir, "cuda", torch.float32, fold=True)
    vocoder64 = copy.deepcopy(vocoder).double()
    gen = torch.Generator(device="cuda").manual_seed(5)
    for rows, frames, cached in [(2, 56, 0), (3, 108, 3840)]:
        graph = GraphedHift(vocoder, frames, cached, rows=4, mix=compiled_mix() if compiled else None)
        mel = torch.randn(rows, 80, frames, device="cuda", generator=gen) * 2 - 6
        cache = torch.randn(rows, 1, cached, device="cuda", generator=gen) * 0.1 if cached else None
        wav, source = graph.inference(mel, cache)
        assert wav.shape == (rows, frames * 480) and source.shape == (rows, 1, frames * 480)
        if cached:
            assert torch.equal(source[..., :cached], cache)  # the excitation continues the previous chunk's
        with torch.inference_mode():
            eager, exact = vocoder.decode(mel, source), vocoder64.decode(mel.double(), source.double())
        noise = float((eager.double() - exact).abs().max())
        assert float((wav.double() - exact).abs().max()) <= 3 * noise + 1e-5
        assert float((wav - eager).abs().mean()) < 1e-4


def test_graphs_that_draw_use_generators_of_their_own_not_the_default_one(tiny_model_dir: Path) -> None:
    """Graphs replay from several threads with no lock (accel/graph_capture): that is safe only if
    no two of them draw from one generator. A decode graph draws from its decoder's generator and
    each HiFT graph from its own; replaying them leaves the default generator where it was."""
    from tts_core.accel.batched_sampler import BatchedRasSampler
    from tts_core.accel.hift_graphs import GraphedHift
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.hift import load_hift
    from tts_core.llm.sampling import SamplingConfig
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    lm.setup_cache(5, 64)
    sampler = BatchedRasSampler(SamplingConfig(), lm.speech_token_size)
    decoder = GraphedDecoder(lm, sampler, (1, 2), (64,), compile=False)
    vocoder = load_hift(tiny_model_dir, "cuda", torch.float32, fold=True)
    hifts = [GraphedHift(vocoder, 56), GraphedHift(vocoder, 56)]
    mel = torch.randn(1, 80, 56, generator=torch.Generator().manual_seed(0)).cuda() - 6
    default = torch.cuda.default_generators[torch.cuda.current_device()]
    generators = [decoder.generator, *(h.generator for h in hifts)]
    assert len({id(g) for g in generators}) == 3 and all(g is not default for g in generators)
    before, offsets = default.get_offset(), [g.get_offset() for g in generators]
    decoder.seed([0], [[1, 2, 3]])
    decoder.launch([0], [True], kv_len=8).result()
    for h in hifts:
        h.inference(mel)
    torch.cuda.synchronize()
    assert default.get_offset() == before
    assert all(g.get_offset() > o for g, o in zip(generators, offsets))
    # Different generators, so two HiFT graphs draw different excitations for one mel.
    assert not torch.equal(hifts[0].inference(mel)[1], hifts[1].inference(mel)[1])


def test_a_full_solve_set_is_captured_on_another_thread_and_swapped_in_while_calls_render(tiny_model_dir: Path,
                                                                                          golden_dir: Path,
                                                                                          monkeypatch) -> None:
    """Start-up captures only the largest bucket (defer=True): every call fits it, padded, with the
    golden output; the full set is captured on another thread (`capture_set`, as the tts-compile
    thread does) while this one keeps rendering, and swapped in at this thread's swap point; the
    output stays golden throughout and after."""
    import threading

    from tts_core.accel.graph_swap import GraphSwap

    _, case, pooled, voice, graphs = _golden_pool_graphs(tiny_model_dir, golden_dir, monkeypatch, True)
    graphs.capture(rows=(1, 4), ctx_caps=(50, 150, 250), new_caps=(112,), parts=2, defer=True)
    assert set(graphs.solve_graphs) == {(4, 250, 112)} and len(graphs.deferred) == 5
    first = case["first_hop"] + case["pre_lookahead_len"]
    tokens = case["tokens"][:, :first].cuda()
    swap = GraphSwap(graphs.solve_graphs)

    def render_first_chunk() -> None:
        if swap.pending:  # the swap point: between renders, on the replaying thread
            graphs.solve_graphs = swap.take()
        stream = pooled.open_stream(voice)
        out = graphs.render([stream], [tokens], [False])[0]
        pooled.close_stream(stream)
        assert (out.cpu() - case["mel_stream_first"]).abs().max().item() <= 1e-4

    render_first_chunk()  # padded into 4 rows and 250 context frames
    worker = threading.Thread(target=lambda: swap.publish(graphs.capture_set(graphs.estimator)))
    worker.start()
    renders = 0
    while worker.is_alive() or renders == 0:
        render_first_chunk()
        renders += 1
    worker.join()
    render_first_chunk()  # now in its own bucket (1, 50, 112)
    assert len(graphs.solve_graphs) == 6 and swap.swaps == 1
    assert graphs.eager_calls == 0
