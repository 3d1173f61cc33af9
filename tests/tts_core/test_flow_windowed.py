"""tts_core.flow.windowed: a cached Euler trajectory reproduces the official streaming calls.

Exact mode (context = every earlier frame) must equal the golden streaming mels within 1e-4 (float32
rounding of differently shaped matmuls, as in test_golden_flow), also when streams of different
lengths share one padded batch. Bounded mode must run with constant cache size; its distance from
the exact output is reported (random tiny weights: a figure for the notes, not a quality claim).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog
import torch

from tts_core.flow import FlowModel, load_flow
from tts_core.flow.windowed import EXACT, WindowedFlowState, WindowPolicy, render_windowed

TOL = 1e-4
log = structlog.get_logger(__name__)


@pytest.fixture(scope="module")
def flow(tiny_model_dir: Path) -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(tiny_model_dir)


@pytest.fixture(scope="module")
def case(golden_dir: Path) -> dict:
    return torch.load(golden_dir / "cases" / "flow.pt", weights_only=False)


@pytest.fixture(scope="module")
def speaker(tiny_model_dir: Path) -> dict:
    return next(iter(torch.load(tiny_model_dir / "spk2info.pt", weights_only=False).values()))


def _state(flow: FlowModel, speaker: dict, policy: WindowPolicy = EXACT) -> WindowedFlowState:
    return WindowedFlowState(flow, speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"],
                             speaker["flow_embedding"], policy)


def _official(flow: FlowModel, speaker: dict, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
    pt, pf = speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"]
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), speaker["flow_embedding"], streaming=True, finalize=finalize)
    return mel


def _golden_calls(case: dict) -> list[tuple[str, int, bool]]:
    first = case["first_hop"] + case["pre_lookahead_len"]
    return [("mel_stream_first", first, False), ("mel_stream_second", first + case["hop"], False),
            ("mel_stream_final", case["tokens"].size(1), True)]


def test_golden_exact_window_matches_official_streaming_calls(flow: FlowModel, case: dict, speaker: dict) -> None:
    # Two streams in one batch: a row must come out as it would alone.
    states = [_state(flow, speaker), _state(flow, speaker)]
    done = 0
    for key, n_tokens, finalize in _golden_calls(case):
        outs = render_windowed(flow, states, [case["tokens"][:, :n_tokens]] * 2, [finalize] * 2)
        expected = case[key][:, :, done:]  # the official caller plays only the frames it has not played
        for new in outs:
            assert new.shape == expected.shape
            assert (new - expected).abs().max().item() <= TOL, key
        done = case[key].size(2)


def test_parity_exact_window_with_streams_at_different_lengths_in_one_batch(flow: FlowModel, case: dict,
                                                                             speaker: dict) -> None:
    # Stream A ends calls inside chunks (20, 41 tokens: the unfinished chunk is re-rendered next
    # call); stream B is one chunk behind. Padding of context and new frames differs per row.
    tokens = case["tokens"]
    a, b = _state(flow, speaker), _state(flow, speaker)
    schedule = [((20, False), (28, False)), ((41, False), (53, False)), ((tokens.size(1), True), (78, False))]
    done = {"a": 0, "b": 0}
    for (na, fa), (nb, fb) in schedule:
        new_a, new_b = render_windowed(flow, [a, b], [tokens[:, :na], tokens[:, :nb]], [fa, fb])
        for name, new, n, fin in (("a", new_a, na, fa), ("b", new_b, nb, fb)):
            expected = _official(flow, speaker, tokens[:, :n], fin)[:, :, done[name]:]
            assert new.shape == expected.shape
            assert (new - expected).abs().max().item() <= TOL, (name, n)
            done[name] += new.size(2)


def test_bounded_window_keeps_cache_constant_and_stays_near_exact(flow: FlowModel, speaker: dict) -> None:
    total = 200
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, total), generator=torch.Generator().manual_seed(0))
    policy = WindowPolicy(prompt_chunks=1, recent_chunks=2, encoder_tokens=50)
    exact, bounded = _state(flow, speaker), _state(flow, speaker, policy)
    sizes, errors = [], []
    ends = [28, *range(53, total, 25)]
    for i, n in enumerate(ends + [total]):
        finalize = i == len(ends)
        ref = render_windowed(flow, [exact], [tokens[:, :n]], [finalize])[0]
        out = render_windowed(flow, [bounded], [tokens[:, :n]], [finalize])[0]
        assert out.shape == ref.shape
        errors.append(((out - ref).abs().max().item(), ((out - ref).norm() / ref.norm()).item()))
        if not finalize:
            sizes.append(bounded.cache.size(2))
    # Prompt's last chunk + 2 recent chunks, whatever the length (exact keeps growing).
    assert sizes[-3:] == [3 * flow.cfg.estimator.static_chunk_size] * 3
    assert exact.cache.size(2) > bounded.cache.size(2)
    assert errors[0] == (0.0, 0.0)  # the first call has no past to cut
    assert all(torch.isfinite(torch.tensor(e)).all() for e in errors)
    log.info("bounded_window_difference", per_call_max_abs_rel=errors)


def _renderer_matches_reference(flow: FlowModel, case: dict, speaker: dict, capture: bool) -> None:
    from tts_core.accel.flow_batch import BatchedFlowRenderer

    renderer = BatchedFlowRenderer(flow)
    if capture:
        # Later-chunk bucket: 3 cached chunks of context (150 frames), 50 new frames, 78 encoder tokens.
        renderer.capture(ctx_cap=200, new_cap=50, enc_tokens=103, batches=(2, 4))
    ours, ref = [_state(flow, speaker) for _ in range(3)], [_state(flow, speaker) for _ in range(3)]
    tokens = case["tokens"]
    for n, finalize in ((28, False), (53, False), (78, False), (tokens.size(1), True)):
        got = renderer.render(ours, [tokens[:, :n]] * 3, [finalize] * 3)
        want = render_windowed(flow, ref, [tokens[:, :n]] * 3, [finalize] * 3)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            assert (g - w).abs().max().item() <= TOL, n


def test_batched_renderer_eager_fallback_equals_reference(flow: FlowModel, case: dict, speaker: dict) -> None:
    _renderer_matches_reference(flow, case, speaker, capture=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_renderer_graphs_equal_eager_on_cuda(tiny_model_dir: Path, case: dict, speaker: dict) -> None:
    flow = load_flow(tiny_model_dir, "cuda", torch.float32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    _renderer_matches_reference(flow, case, speaker, capture=True)
