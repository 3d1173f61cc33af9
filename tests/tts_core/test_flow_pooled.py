"""tts_core.flow.pooled: many streams rendered from one context pool equal the official streaming calls.

The golden streaming mels (official implementation) are the reference: each frame is computed once
from the pooled context, so the output must match within 1e-4 (float32 rounding of differently
shaped matmuls, as in test_golden_flow), also when streams of different lengths, a stream's first
call and another's final call share one padded batch, and when the voice prompt's shared frames
come from the voice's slot rather than being recomputed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tts_core.flow import FlowModel
from tts_core.flow.context_pool import PoolShape
from tts_core.flow.pooled import PooledFlow
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule

TOL = 1e-4


def _pooled(flow: FlowModel, speaker: dict, stream_frames: int = 400, encoder_tokens: int | None = None,
            int8: bool = False):
    pooled = PooledFlow(flow, PoolShape(stream_slots=3, stream_frames=stream_frames, voice_slots=2,
                                        voice_frames=100, prompt_frames=200, int8=int8), encoder_tokens)
    dtype = pooled.dtype
    voice = pooled.register_voice(speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"].to(dtype),
                                  speaker["flow_embedding"].to(dtype))
    return pooled, voice


def _two_streams_one_chunk_apart(flow: FlowModel, speaker: dict, tokens: torch.Tensor, int8: bool = False):
    """A fresh pool with streams a (its first chunk rendered) and b (none), and the plans and
    encoder outputs of one call that renders a's second chunk and b's first."""
    from tts_core.flow.encoder_window import encode_grouped

    pooled, voice = _pooled(flow, speaker, int8=int8)
    a, b = pooled.open_stream(voice), pooled.open_stream(voice)
    pooled.render([a], [tokens[:, :28]], [False])
    plans = [pooled.plan(a, tokens[:, :53], False), pooled.plan(b, tokens[:, :28], False)]
    return pooled, a, b, plans, encode_grouped(flow, plans)


def test_golden_pooled_streams_match_official_streaming_calls(flow: FlowModel, flow_case: dict, speaker: dict) -> None:
    pooled, voice = _pooled(flow, speaker)
    assert voice.prefix_frames == 50  # 50 prompt tokens: the first chunk is shared, the second is not
    streams = [pooled.open_stream(voice), pooled.open_stream(voice)]
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    calls = [("mel_stream_first", first, False), ("mel_stream_second", first + flow_case["hop"], False),
             ("mel_stream_final", flow_case["tokens"].size(1), True)]
    done = 0
    for key, n_tokens, finalize in calls:
        outs = pooled.render(streams, [flow_case["tokens"][:, :n_tokens]] * 2, [finalize] * 2)
        expected = flow_case[key][:, :, done:]  # the official caller plays only the frames it has not played
        for new in outs:
            assert new.shape == expected.shape
            assert (new - expected).abs().max().item() <= TOL, key
        done = flow_case[key].size(2)


def test_parity_streams_at_different_lengths_share_one_batch(flow: FlowModel, flow_case: dict, speaker: dict,
                                                             official_call) -> None:
    # Stream A ends calls inside chunks (20, 41 tokens: the unfinished chunk is re-rendered next
    # call, exactly as the official re-run does); stream B is a chunk behind; C joins late, so its
    # first call shares a batch with A's final one.
    tokens = flow_case["tokens"]
    heard: dict[str, list[torch.Tensor]] = {"a": [], "b": [], "c": []}
    pooled, voice = _pooled(flow, speaker)
    a, b = pooled.open_stream(voice), pooled.open_stream(voice)
    schedule = [((20, False), (28, False)), ((41, False), (53, False))]
    for (na, fa), (nb, fb) in schedule:
        out_a, out_b = pooled.render([a, b], [tokens[:, :na], tokens[:, :nb]], [fa, fb])
        heard["a"].append(out_a)
        heard["b"].append(out_b)
    c = pooled.open_stream(voice)
    out_a, out_c = pooled.render([a, c], [tokens, tokens[:, :28]], [True, False])
    heard["a"].append(out_a)
    heard["c"].append(out_c)
    out_b, out_c = pooled.render([b, c], [tokens, tokens], [True, True])
    heard["b"].append(out_b)
    heard["c"].append(out_c)
    full = official_call(tokens, True)
    for name, parts in heard.items():
        mel = torch.cat(parts, dim=2)
        assert mel.shape == full.shape, name
        # Frames of a call that ends inside a chunk are what the official call of that length gives.
        ref = {"a": [official_call(tokens[:, :20], False), official_call(tokens[:, :41], False)],
               "b": [official_call(tokens[:, :28], False), official_call(tokens[:, :53], False)],
               "c": [official_call(tokens[:, :28], False)]}[name]
        expected, done = [], 0
        for r in ref:
            expected.append(r[:, :, done:])
            done = r.size(2)
        expected.append(full[:, :, done:])
        assert (mel - torch.cat(expected, dim=2)).abs().max().item() <= TOL, name


def test_slots_are_reused_and_a_closed_stream_cannot_render(flow: FlowModel, flow_case: dict, speaker: dict) -> None:
    pooled, voice = _pooled(flow, speaker)
    s = pooled.open_stream(voice)
    pooled.render([s], [flow_case["tokens"]], [True])
    pooled.close_stream(s)
    pooled.close_stream(s)  # idempotent
    assert pooled.pool.free_streams == 3
    with pytest.raises(RuntimeError):
        pooled.render([s], [flow_case["tokens"]], [True])
    # A stream in a reused slot is not disturbed by what the slot held before.
    again = pooled.open_stream(voice)
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    out = pooled.render([again], [flow_case["tokens"][:, :first]], [False])[0]
    assert (out - flow_case["mel_stream_first"]).abs().max().item() <= TOL


def test_a_stream_longer_than_its_ring_keeps_its_latest_chunks(flow: FlowModel, flow_case: dict, speaker: dict,
                                                               official_call) -> None:
    # 50 own frames per slot: later calls see the voice prefix plus the latest chunk only.
    tokens = flow_case["tokens"]
    pooled, voice = _pooled(flow, speaker, stream_frames=50)
    s = pooled.open_stream(voice)
    outs = [pooled.render([s], [tokens[:, :n]], [False])[0] for n in (28, 53, 78)]
    outs.append(pooled.render([s], [tokens], [True])[0])
    mel = torch.cat(outs, dim=2)
    full = official_call(tokens, True)
    assert mel.shape == full.shape and torch.isfinite(mel).all()
    assert s.slid
    # The first two calls (context within the ring) are still exact.
    assert (outs[0] - flow_case["mel_stream_first"]).abs().max().item() <= TOL


def test_padding_rows_and_larger_buckets_change_nothing(flow: FlowModel, flow_case: dict, speaker: dict) -> None:
    # What a captured graph bucket does to a call: more context and new-frame capacity than the rows
    # need, and padding rows that must read nothing and write only to the trash.
    from tts_core.flow.pooled import pooled_solve

    tokens = flow_case["tokens"]
    results = []
    for ctx_extra, new_extra, padding in ((0, 0, 0), (150, 30, 3)):
        pooled, a, b, plans, mus = _two_streams_one_chunk_apart(flow, speaker, tokens)
        ctx = max(p.ctx_frames for p in plans) + ctx_extra
        new = max(p.new_frames for p in plans) + new_extra
        rows = [p.row for p in plans] + [pooled.padding_row()] * padding
        table = pooled.table(rows)
        with torch.inference_mode():
            mel = pooled_solve(flow, pooled.pool, table, pooled.stack_mu(mus, len(rows), new), ctx, pooled.steps)
        assert torch.isfinite(mel).all()
        outs = [pooled.finish(s, p, mel[i:i + 1, :, :p.new_frames]) for i, (s, p) in enumerate(zip((a, b), plans))]
        # The frames the call kept in the pool must be the same too: render a's next chunk from them.
        outs.append(pooled.render([a], [tokens[:, :78]], [False])[0])
        results.append(outs)
    for plain, bucketed in zip(*results):
        assert plain.shape == bucketed.shape
        assert (plain - bucketed).abs().max().item() <= TOL


def test_a_solve_cut_into_parts_gives_what_the_whole_solve_gives(flow: FlowModel, flow_case: dict,
                                                                   speaker: dict) -> None:
    # What a solve captured as several graphs runs (accel/flow_pool_graphs): the parts in order,
    # each from the state the part before left. Same mel, same frames kept in the pool, bit for bit.
    from tts_core.flow.pooled import SolveParts

    tokens = flow_case["tokens"]
    results = []
    for parts in (1, 3, 10):
        pooled, a, b, plans, mus = _two_streams_one_chunk_apart(flow, speaker, tokens)
        new = max(p.new_frames for p in plans)
        solve = SolveParts(flow, pooled.pool, pooled.table([p.row for p in plans]), pooled.stack_mu(mus, 2, new),
                           max(p.ctx_frames for p in plans), pooled.steps, None, parts)
        assert solve.bounds[0] == 0 and solve.bounds[-1] == len(pooled.steps) and solve.parts == parts
        with torch.inference_mode():
            for k in range(parts - 1):
                assert solve.run(k).dtype == pooled.dtype  # x between parts, in the flow's dtype
            mel = solve.run(parts - 1)
        assert mel.dtype == torch.float32 and solve.x is None and solve.inputs is None
        outs = [pooled.finish(s, p, mel[i:i + 1, :, :p.new_frames]) for i, (s, p) in enumerate(zip((a, b), plans))]
        outs.append(pooled.render([a], [tokens[:, :78]], [False])[0])  # from the frames the parts kept
        results.append(outs)
    for whole, cut in ((results[0], r) for r in results[1:]):
        for x, y in zip(whole, cut):
            assert torch.equal(x, y)
    with pytest.raises(ValueError, match="cannot be cut into 11 parts"):
        SolveParts(flow, pooled.pool, pooled.table([0]), mus[0], 0, pooled.steps, None, 11)


@pytest.mark.parametrize("int8", [False, True])
def test_a_compiled_estimator_step_serves_every_euler_step_and_changes_nothing(flow: FlowModel, flow_case: dict,
                                                                              speaker: dict, int8: bool) -> None:
    # What compile_flow does to a captured solve (accel/flow_pool_graphs), on CPU: the same mel and
    # the same kept frames, from one compiled graph per module shape for all ten steps: the
    # transformer blocks two (before and after their attention), the resnets one per input width
    # (down, middle, up): the first middle resnet reads a convolution's output, the others a
    # transformer block's, transposed, and both are channels-last (NhwcConv1d; before, the
    # convolution's was not and took one compile more).
    # A module or step told apart by anything but its tensors' shapes would compile more. The same with
    # an int8 pool (its codes quantised and read back inside the compiled halves).
    from torch._dynamo.utils import counters
    from torch._inductor import config as inductor_config

    from tts_core.accel.flow_pool_graphs import compiled_estimator
    from tts_core.flow.pooled import pooled_solve

    tokens = flow_case["tokens"]
    # It counts the compiles this call makes: the compiled regions' caches must start empty. Run
    # after the CUDA graph tests in one process (on a GPU host) they held those tests' compiles.
    torch._dynamo.reset()
    compiled = compiled_estimator(flow.decoder.estimator)
    graphs: list[torch.fx.Graph] = []
    results = []
    for estimator in (None, compiled):
        pooled, a, b, plans, mus = _two_streams_one_chunk_apart(flow, speaker, tokens, int8)
        new = max(p.new_frames for p in plans)
        compiles = counters["stats"]["unique_graphs"]
        with torch.inference_mode(), inductor_config.patch(post_grad_custom_post_pass=graphs.append):
            mel = pooled_solve(flow, pooled.pool, pooled.table([p.row for p in plans]),
                               pooled.stack_mu(mus, len(plans), new), max(p.ctx_frames for p in plans), pooled.steps,
                               estimator)
        widths = {r.block1.block[0].in_channels for r in flow.decoder.estimator.resnets()}
        assert counters["stats"]["unique_graphs"] - compiles == (0 if estimator is None else 2 + len(widths))
        outs = [pooled.finish(s, p, mel[i:i + 1, :, :p.new_frames]) for i, (s, p) in enumerate(zip((a, b), plans))]
        outs.append(pooled.render([a], [tokens[:, :78]], [False])[0])  # eager, from the kept frames
        results.append(outs)
    for eager, fused in zip(*results):
        assert eager.shape == fused.shape
        assert (eager - fused).abs().max().item() <= TOL
    # Every compiled graph reads a pool tensor before it writes it. A read left after a write makes
    # inductor keep the old contents in a copy of the whole tensor: on the H100 that made the
    # flow solve 2.3x slower (docs/PERF_NOTES.md, "2026-11-23 (night, second)").
    assert len(graphs) == 2 + len(widths)
    reads = (torch.ops.aten.index.Tensor, torch.ops.aten.index_select.default)
    for graph in graphs:
        nodes = list(graph.nodes)
        for position, node in enumerate(nodes):
            if node.target in (torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default):
                pool = node.args[0]
                assert not [n for n in nodes[position:] if n.target in reads and n.args[0] is pool], \
                    f"{pool} is read after it is written in\n{graph}"


@pytest.mark.parametrize("int8", [False, True])
def test_the_pool_asks_the_device_for_exactly_what_it_allocates(flow: FlowModel, speaker: dict, int8: bool) -> None:
    """The start-up check (tts_core/accel/device_memory.py) is made of the pool's own plan: a GPU refuses a
    pool too large for it before torch fails the allocation with sizes that name neither slots nor context."""
    pooled, _ = _pooled(flow, speaker, int8=int8)
    assert pooled.pool.planned_bytes == pooled.pool.nbytes()


def _golden_stream(pooled: PooledFlow, voice, flow_case: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One stream's calls on the golden schedule: (our new frames, the official's) per call."""
    stream = pooled.open_stream(voice)
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    calls = [("mel_stream_first", first, False), ("mel_stream_second", first + flow_case["hop"], False),
             ("mel_stream_final", flow_case["tokens"].size(1), True)]
    pairs, done = [], 0
    with torch.inference_mode():
        for key, n_tokens, finalize in calls:
            mel = pooled.render([stream], [flow_case["tokens"][:, :n_tokens]], [finalize])[0].float()
            pairs.append((mel, flow_case[key][:, :, done:]))
            done = flow_case[key].size(2)
    return pairs


def test_an_int8_context_keeps_each_frame_within_half_a_code(flow: FlowModel, speaker: dict) -> None:
    # Symmetric codes with a scale a frame: every kept value comes back within half a code (its frame's
    # largest magnitude / 254), an all-zero frame as zeros, whatever the frame's range.
    from tts_core.flow.context_pool import PooledStepContext

    pooled, _ = _pooled(flow, speaker, int8=True)
    pool = pooled.pool
    layer = next(iter(pool.hidden))
    width = pool.hidden[layer].size(1)
    frames = torch.randn(6, width, generator=torch.Generator().manual_seed(3)) * torch.tensor(
        [[1e-3], [1.0], [40.0], [0.0], [1.0], [7.0]])
    frames[4, 5] = 300.0  # one large value: the rest of its frame is coarser, never wrong by more than the bound
    rows = torch.arange(6) + 2 * pool.frames  # step 1's conditioned rows of stream frames 0-5
    index = SimpleNamespace(write_rows=rows, ctx_rows=rows)
    context = PooledStepContext(pool, index).attention(layer)
    context.keep(frames)
    back = context.context_inputs(torch.float32)
    bound = frames.abs().amax(-1, keepdim=True) / 254
    assert ((back - frames).abs() <= bound * (1 + 1e-5)).all()
    assert (back[3] == 0).all()
    assert pool.hidden[layer].dtype == torch.int8


def test_an_int8_context_moves_the_golden_streams_less_than_bfloat16_does(flow: FlowModel, flow_case: dict,
                                                                          speaker: dict, tiny_model_dir) -> None:
    # What the halved pool costs, against what the GPU's dtype already costs: the same golden stream with
    # an exact bf16 pool moves further from the official than fp32 with int8 codes (measured on the shared
    # set: 0.002-0.004 % against 1.1-1.2 % of the mean |mel|, docs/PERF_NOTES.md "The flow context in int8").
    from tts_core.flow import load_flow

    exact, exact_voice = _pooled(flow, speaker)
    int8, int8_voice = _pooled(flow, speaker, int8=True)
    bf16_flow = load_flow(tiny_model_dir, "cpu", torch.bfloat16)
    bf16, bf16_voice = _pooled(bf16_flow, speaker)
    assert int8.pool.nbytes() < exact.pool.nbytes() / 2  # codes + a scale a frame, against fp32 values
    for (ours, official), (ref, _), (half, _) in zip(_golden_stream(int8, int8_voice, flow_case),
                                                    _golden_stream(exact, exact_voice, flow_case),
                                                    _golden_stream(bf16, bf16_voice, flow_case)):
        assert (ref - official).abs().max().item() <= TOL  # the exact pool is the official's
        moved = (ours - official).abs().mean().item()
        assert 0 < moved < (half - official).abs().mean().item()


@pytest.mark.parametrize("window_chunks", [None, 0, 1])
def test_a_streams_call_shapes_are_known_before_the_calls(flow: FlowModel, flow_case: dict, speaker: dict,
                                                          window_chunks: int | None) -> None:
    # The engine captures the encoder graphs of each voice's first calls from `call_shape` at start-up; a shape
    # that differs from what `plan` gives that call would run the encoder uncaptured on every call's chunk.
    # Every first hop the tokens allow, each followed by the hops its ChunkPlanner gives (off the chunk grid,
    # a second hop back to it). Windows: every token; none before the call's chunk (the window starts past the
    # prompt's first chunk); one chunk before it.
    chunk = flow.cfg.encoder.static_chunk_size
    pooled, voice = _pooled(flow, speaker, encoder_tokens=None if window_chunks is None else window_chunks * chunk)
    lookahead, tokens = flow_case["pre_lookahead_len"], flow_case["tokens"]
    calls = 0
    for first_hop in range(1, tokens.size(1) - lookahead + 1):
        planner = ChunkPlanner(ChunkSchedule(hop_tokens=chunk, max_hop_tokens=2 * chunk, first_hop_tokens=first_hop),
                               voice.prompt_token.size(1))
        stream = pooled.open_stream(voice)
        hops: list[int] = []
        while (task := planner.next_chunk(tokens.size(1), lm_finished=False)) is not None:
            hops.append(task.token_end - lookahead - task.token_offset)
            plan = pooled.plan(stream, tokens[:, :task.token_end], False)
            assert pooled.call_shape(voice, hops) == (plan.enc_tokens.size(1), plan.new_frames), hops
            pooled.finish(stream, plan, torch.zeros(1, flow.cfg.output_size, plan.new_frames))  # bookkeeping only
            calls += 1
        pooled.close_stream(stream)
    assert calls > tokens.size(1) - lookahead  # second calls too, not only first ones
