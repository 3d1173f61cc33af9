"""CosyVoice3's pooled DiT (tts_core/flow/dit_pool.py) on the tiny golden model: each streaming chunk
renders only its new frames from kept keys/values and comes out as the official re-render's
(`stream_calls`, `mel_stream_full`, and our re-render path `token2wav3.chunk_mel`): on the official
schedule, on prompts that end inside a chunk, on hops that end inside one (the unfinished chunk is
recomputed), batched over streams of several voices; and past its window exactly as stated (each
chunk sees the voice's shared frames and the stream's latest window of own frames).

Every size is read from the golden files. Float32 on CPU; the pool attends over [kept keys | new
keys] where a re-render attends over all frames at once, so results agree to rounding (~1e-6).
"""

from __future__ import annotations

import copy

import pytest
import torch

from tts_core.flow.chunk_mask import chunk_attention_mask
from tts_core.flow.dit_flow import DiTFlowModel
from tts_core.flow.dit_pool import DiTContextPool, DiTRow, DiTTables, frame_bytes, shared_prompt_frames
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule
from tts_core.streaming.token2wav3 import chunk_mel

MEL_TOL = 1e-4  # measured <= 2e-6


def _prompt(speaker3: dict, tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The golden speaker's flow prompt, cut to its first `tokens` tokens (and their frames)."""
    pt = speaker3["flow_prompt_speech_token"].long()
    n = pt.size(1) if tokens is None else tokens
    return pt[:, :n], speaker3["prompt_speech_feat"][:, :2 * n], speaker3["flow_embedding"]


def _schedule(flow3_case: dict, hop: int | None = None) -> ChunkSchedule:
    return ChunkSchedule(hop_tokens=hop or flow3_case["hop"], max_hop_tokens=flow3_case["max_hop"],
                         hop_scale=flow3_case["stream_scale_factor"], lookahead_tokens=flow3_case["pre_lookahead_len"])


def _pool(flow3: DiTFlowModel, slots: int = 3, stream_frames: int = 1000) -> DiTContextPool:
    return DiTContextPool(flow3.decoder, slots, stream_frames, 400, next(flow3.parameters()).device, torch.float32)


def _add_voice(pool: DiTContextPool, flow3: DiTFlowModel, key: str, prompt: tuple) -> None:
    pt, pf, emb = prompt
    frames = shared_prompt_frames(pf.size(1), pt.size(1), flow3.cfg.token_mel_ratio, flow3.cfg.pre_lookahead_len,
                                  pool.chunk)
    c = flow3.condition(pt[:, :0], pt, pf, emb, True)
    pool.add_voice(key, frames, c.mu, c.cond, c.spks)


def _render(pool: DiTContextPool, flow3: DiTFlowModel, calls: list[tuple[int, tuple, torch.Tensor, object]],
            solve=None) -> list[torch.Tensor]:
    """One batched pool call: per (slot, prompt, tokens, task) the chunk's new frames (1, 80, n). `solve`:
    what runs it (default `pool.solve`; a padded bucket's solve, or captured graphs' `solve`)."""
    conds = []
    for _, (pt, pf, emb), tokens, task in calls:
        conds.append(flow3.condition(tokens[:, :task.token_end], pt, pf, emb, task.finalize))
    rows = [pool.row(slot, c.mu.size(2), keep=not task.finalize) for (slot, _, _, task), c in zip(calls, conds)]
    n = max(r.end - r.start for r in rows)
    mu = torch.zeros(len(rows), 80, n, device=conds[0].mu.device)
    cond = torch.zeros_like(mu)
    for i, (r, c) in enumerate(zip(rows, conds)):
        mu[i, :, :r.end - r.start], cond[i, :, :r.end - r.start] = c.mu[0, :, r.start:], c.cond[0, :, r.start:]
    mel = (solve or pool.solve)(rows, mu, cond, torch.cat([c.spks for c in conds]))
    for (slot, _, _, _), r in zip(calls, rows):
        pool.advance(slot, r)
    ratio = flow3.cfg.token_mel_ratio
    return [mel[i:i + 1, :, c.prompt_frames + ratio * task.token_offset - r.start:r.end - r.start]
            for i, (r, c, (_, _, _, task)) in enumerate(zip(rows, conds, calls))]


def _padded_solve(pool: DiTContextPool, pad_rows: int, pad_ctx: int, pad_new: int):
    """`pool.solve` run as a captured graph bucket runs it: the call padded with `pad_rows` padding rows,
    `pad_ctx` more context and `pad_new` more new frames (zero inputs there), the real rows read back."""
    def solve(rows: list[DiTRow], mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        b, n = len(rows), mu.size(2)
        c = max(len(r.context) for r in rows)
        big = (b + pad_rows, c + pad_ctx, n + pad_new)
        tables = DiTTables(pool.table(rows, *big), *big)
        mu_p, cond_p = (torch.nn.functional.pad(y, (0, pad_new, 0, 0, 0, pad_rows)) for y in (mu, cond))
        spks_p = torch.nn.functional.pad(spks, (0, 0, 0, pad_rows))
        return pool.solve_tables(tables, mu_p, cond_p, spks_p)[:b, :, :n]
    return solve


def _tasks(schedule: ChunkSchedule, prompt_tokens: int, tokens: int) -> list:
    planner, tasks = ChunkPlanner(schedule, prompt_tokens), []
    while (task := planner.next_chunk(tokens, lm_finished=True)) is not None:
        tasks.append(task)
    return tasks


def test_each_golden_streaming_chunk_renders_only_its_new_frames_as_the_official_call(
        flow3: DiTFlowModel, flow3_case: dict, speaker3: dict) -> None:
    """The golden streaming calls, one by one from the pool: each non-final chunk's new frames equal the
    official call's (`stream_calls`), computed from the voice's shared frames and the stream's kept
    ones only; the chunk-masked final chunk equals `mel_stream_full`'s tail."""
    pool, prompt = _pool(flow3), _prompt(speaker3)
    _add_voice(pool, flow3, "golden", prompt)
    chunk = flow3_case["static_chunk_size"]
    pool.start_stream(0, "golden")
    tokens = flow3_case["tokens"].long()
    calls = flow3_case["stream_calls"]
    tasks = _tasks(_schedule(flow3_case), prompt[0].size(1), tokens.size(1))
    assert [(t.token_offset, t.token_end, t.finalize) for t in tasks] == [
        (c["token_offset"], c["n_tokens"], c["finalize"]) for c in calls]
    for task, call in zip(tasks, calls):
        start = pool.kept_until(0)
        (new,) = _render(pool, flow3, [(0, prompt, tokens, task)])
        if not call["streaming"]:  # the official final call is a full-attention one: see the next test
            offset = 2 * call["token_offset"]
            official = flow3_case["mel_stream_full"][:, :, offset:offset + new.size(2)]
        else:
            official = call["mel_new"]
            assert start % chunk == 0 and pool.kept_until(0) == prompt[1].size(1) + 2 * (
                call["n_tokens"] - flow3_case["pre_lookahead_len"])  # kept up to its end: nothing recomputed later
        assert new.shape == official.shape
        assert (new - official).abs().max().item() <= MEL_TOL


@pytest.mark.parametrize("padded", [False, True], ids=["exact_call", "padded_as_a_graph_bucket"])
@pytest.mark.parametrize("prompt_tokens, hop", [(None, None), (37, None), (37, 7), (21, 12)],
                         ids=["golden", "prompt_ends_mid_chunk", "hops_end_mid_chunk", "short_prompt"])
def test_batched_streams_of_two_voices_equal_the_re_render_chunk_by_chunk(
        flow3: DiTFlowModel, flow3_case: dict, speaker3: dict, prompt_tokens: int | None, hop: int | None,
        padded: bool) -> None:
    """Three streams (two voices: the golden prompt and a cut one) of different lengths, every round's
    due chunks in one pooled solve: each chunk equals our re-render (`chunk_mel`, chunk-masked final),
    whether prompt and hops end on chunk boundaries (the official schedule) or not (an unfinished
    chunk's frames are recomputed by the next call, never kept). Also when each call is padded as a
    CUDA-graph bucket pads it (padding rows, more context and new frames than any row has): what
    the padding computes is neither seen by the real rows nor kept."""
    pool = _pool(flow3)
    solve = _padded_solve(pool, 2, flow3_case["static_chunk_size"] + 3, 11) if padded else None
    prompts = [_prompt(speaker3), _prompt(speaker3, prompt_tokens)]
    for key, prompt in zip(("a", "b"), prompts):
        _add_voice(pool, flow3, key, prompt)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, flow3.cfg.vocab_size, (1, 200), generator=gen)
    lengths = (int(flow3_case["tokens"].size(1)), 61, 143)
    streams = [(0, "a", prompts[0]), (1, "b", prompts[1]), (2, "b", prompts[1])]
    plans = []
    for (slot, key, prompt), length in zip(streams, lengths):
        pool.start_stream(slot, key)
        plans.append(_tasks(_schedule(flow3_case, hop), prompt[0].size(1), length))
    for round_ in range(max(len(p) for p in plans)):
        due = [(s, p[round_]) for s, p in zip(streams, plans) if round_ < len(p)]
        news = _render(pool, flow3, [(slot, prompt, tokens, task) for (slot, _, prompt), task in due], solve)
        for ((_, _, (pt, pf, emb)), task), new in zip(due, news):
            reference = chunk_mel(flow3, tokens[0], task, pt, pf, emb, streaming=True)
            assert new.shape == reference.shape
            assert (new - reference).abs().max().item() <= MEL_TOL


@pytest.mark.parametrize("voice_shared", [True, False], ids=["voice_shared", "prompt_in_own_slot"])
def test_past_its_window_a_stream_sees_the_voice_and_its_latest_own_frames_exactly_as_stated(
        flow3: DiTFlowModel, flow3_case: dict, speaker3: dict, voice_shared: bool) -> None:
    """A window of two chunks on a segment of many: exact (the re-render) while the stream's own frames
    fit; beyond, each call sees the voice's shared frames and the own frames its writes leave, and the
    result equals one render whose chunk mask hides exactly the frames each call did not see (so the
    deviation is that and only that). Also when the voice shares nothing (no room in the pool) and the
    first call alone keeps more frames than the window (prompt + first hop): it keeps its latest."""
    chunk = flow3_case["static_chunk_size"]
    pool, prompt = _pool(flow3, slots=1, stream_frames=2 * chunk), _prompt(speaker3)
    if voice_shared:
        _add_voice(pool, flow3, "golden", prompt)
    else:
        c = flow3.condition(prompt[0][:, :0], *prompt, True)
        pool.add_voice("golden", 0, c.mu, c.cond, c.spks)
    pool.start_stream(0, "golden")
    tokens = flow3_case["tokens"].long()
    tasks = _tasks(_schedule(flow3_case, hop=chunk // 2), prompt[0].size(1), tokens.size(1))
    shared = pool.voice_of[0].frames
    pt, pf, emb = prompt
    full = flow3.condition(tokens, pt, pf, emb, True)
    frames = full.mu.size(2)
    visible = chunk_attention_mask(frames, chunk, -1)
    mel = []
    for task in tasks:
        own, start = pool.own[0], pool.kept_until(0)
        end = pf.size(1) + 2 * (task.token_end - (0 if task.finalize else flow3_case["pre_lookahead_len"]))
        kept = 0 if task.finalize else end // chunk * chunk - start
        first_own = max(0, own + kept - pool.stream_frames)
        visible[start:end, shared:shared + min(first_own, own)] = False  # kept frames this call does not see
        (new,) = _render(pool, flow3, [(0, prompt, tokens, task)])
        mel.append(new)
        if own + kept <= pool.stream_frames:
            reference = chunk_mel(flow3, tokens[0], task, pt, pf, emb, streaming=True)
            assert (new - reference).abs().max().item() <= MEL_TOL
    assert pool.slid == [True]
    # The reference render with that mask, plus one query-only frame at the end that sees every frame:
    # the DiT zeroes the attention output of frames its mask's last row hides (official; padding only).
    visible = torch.cat([torch.cat([visible, torch.zeros(frames, 1, dtype=torch.bool)], dim=1),
                         torch.ones(1, frames + 1, dtype=torch.bool)])
    mu, cond = (torch.nn.functional.pad(y, (0, 1)) for y in (full.mu, full.cond))
    sampler = flow3.decoder
    windowed = sampler.solve(sampler.noise(frames + 1, torch.float32), mu, torch.ones(1, 1, frames + 1), full.spks,
                             cond, visible)
    ours = torch.cat(mel, dim=2)
    assert (ours - windowed[:, :, pf.size(1):frames]).abs().max().item() <= MEL_TOL
    unwindowed = sampler(full.mu, full.mask, full.spks, full.cond, streaming=True)[:, :, pf.size(1):]
    assert (ours - unwindowed).abs().max().item() > 100 * MEL_TOL  # the window does change the tail


def test_a_kept_frame_costs_frame_bytes(flow3: DiTFlowModel) -> None:
    """The pool's memory is `frame_bytes` per frame of its frame axis (what the renderer logs and the
    docs' per-slot figures are made of)."""
    pool = _pool(flow3, slots=2, stream_frames=100)
    assert pool.total_frames == 400 + 2 * 100 + 2  # voices, stream rings, the zero and trash frames
    assert pool.nbytes == pool.total_frames * frame_bytes(flow3.decoder.estimator, pool.steps, 4)
    assert pool.planned_bytes == pool.nbytes  # what the start-up check asked the device for


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("compiled", [False, True], ids=["block_code", "compiled_set_swapped_in"])
def test_captured_solves_replay_the_eager_solve_and_a_call_fitting_no_bucket_runs_eagerly(
        flow3: DiTFlowModel, flow3_case: dict, speaker3: dict, compiled: bool) -> None:
    """The batched rounds of three streams (two voices), once through `pool.solve` and once through a
    lane's captured graphs (`DiTSolveGraphs`: buckets of one and two rows, sized from the first pass;
    or the set recorded again with the blocks' work torch.compile'd, as the tts-compile thread makes
    it): every chunk the same; the calls of three streams fit no bucket, run eagerly and are counted."""
    from tts_core.accel.dit_graphs import DiTSolveGraphs, graph_regions

    flow = copy.deepcopy(flow3).cuda()
    cuda = torch.device("cuda")
    prompts = [tuple(t.to(cuda) for t in _prompt(speaker3, n)) for n in (None, 37)]
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, 200), generator=torch.Generator().manual_seed(5)).to(cuda)
    lengths = (int(flow3_case["tokens"].size(1)), 61, 143)
    streams = [(0, "a", prompts[0]), (1, "b", prompts[1]), (2, "b", prompts[1])]
    calls_seen: list[tuple[int, int, int]] = []  # (rows, context, new frames) of each eager call

    def run(graphs_of) -> tuple[list[torch.Tensor], DiTSolveGraphs | None]:
        pool = _pool(flow)
        for key, prompt in zip(("a", "b"), prompts):
            _add_voice(pool, flow, key, prompt)
        graphs = graphs_of(pool)

        def recording(rows, mu, cond, spks):
            calls_seen.append((len(rows), max(len(r.context) for r in rows), mu.size(2)))
            return pool.solve(rows, mu, cond, spks)

        plans = []
        for (slot, key, prompt), length in zip(streams, lengths):
            pool.start_stream(slot, key)
            plans.append(_tasks(_schedule(flow3_case), prompt[0].size(1), length))
        out = []
        for round_ in range(max(len(p) for p in plans)):
            due = [(s, p[round_]) for s, p in zip(streams, plans) if round_ < len(p)]
            calls = [(slot, prompt, tokens, task) for (slot, _, prompt), task in due]
            out += _render(pool, flow, calls, graphs.solve if graphs is not None else recording)
        return out, graphs

    eager, _ = run(lambda pool: None)
    ctx_cap = max(c for _, c, _ in calls_seen) + 8  # padded: the replays also pad context and frames
    new_cap = max(n for _, _, n in calls_seen) + 8

    def captured(pool: DiTContextPool) -> DiTSolveGraphs:
        graphs = DiTSolveGraphs(pool)
        graphs.capture((1, 2), [ctx_cap], [new_cap])
        if compiled:
            graphs.solve_graphs = graphs.capture_set(graph_regions(compiled=True))
        return graphs

    replayed, graphs = run(captured)
    assert len(replayed) == len(eager)
    for a, b in zip(eager, replayed):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= MEL_TOL
    assert graphs.eager_calls == sum(1 for rows, _, _ in calls_seen if rows > 2) > 0
