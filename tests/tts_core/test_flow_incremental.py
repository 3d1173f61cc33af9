"""tts_core.flow.incremental: chunk-wise rendering equals the official full re-run, at constant work.

Tolerance 1e-4 max abs (values reach ~25), as in test_golden_flow: the chunk-wise path multiplies
the same numbers in differently shaped matmuls, so it differs from the full re-run by float32
rounding only (measured <= 3e-5 against the golden, <= 2e-5 against our own full re-run).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.flow import FlowModel, load_flow
from tts_core.flow.incremental import IncrementalFlow

TOL = 1e-4


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


def _incremental(flow: FlowModel, speaker: dict) -> IncrementalFlow:
    return IncrementalFlow(flow, speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"],
                           speaker["flow_embedding"])


def _full_rerun(flow: FlowModel, speaker: dict, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
    pt, pf = speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"]
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), speaker["flow_embedding"], streaming=True, finalize=finalize)
    return mel


def test_golden_incremental_matches_official_streaming_calls(flow: FlowModel, case: dict, speaker: dict) -> None:
    first = case["first_hop"] + case["pre_lookahead_len"]
    calls = [("mel_stream_first", first, False), ("mel_stream_second", first + case["hop"], False),
             ("mel_stream_final", case["tokens"].size(1), True)]
    renderer = _incremental(flow, speaker)
    done = 0
    for key, n_tokens, finalize in calls:
        new = renderer.render(case["tokens"][:, :n_tokens], finalize)
        expected = case[key][:, :, done:]  # the official caller keeps only the frames it has not played
        assert new.shape == expected.shape
        assert (new - expected).abs().max().item() <= TOL, key
        done = case[key].size(2)


def test_parity_incremental_calls_ending_inside_a_chunk(flow: FlowModel, case: dict, speaker: dict) -> None:
    # Ends at 20 and 41 tokens are not chunk boundaries: the unfinished chunk is re-rendered next call.
    tokens = case["tokens"]
    renderer = _incremental(flow, speaker)
    done = 0
    for n_tokens, finalize in ((20, False), (41, False), (tokens.size(1), True)):
        new = renderer.render(tokens[:, :n_tokens], finalize)
        expected = _full_rerun(flow, speaker, tokens[:, :n_tokens], finalize)[:, :, done:]
        assert new.shape == expected.shape
        assert (new - expected).abs().max().item() <= TOL, n_tokens
        done += new.size(2)


def test_incremental_estimator_sees_only_new_frames_on_aligned_calls(flow: FlowModel, case: dict,
                                                                      speaker: dict) -> None:
    widths: list[int] = []
    hook = flow.decoder.estimator.register_forward_pre_hook(lambda _m, args: widths.append(args[0].size(2)))
    try:
        renderer = _incremental(flow, speaker)
        first = case["first_hop"] + case["pre_lookahead_len"]
        for n_tokens in (first, first + case["hop"]):
            widths.clear()
            new = renderer.render(case["tokens"][:, :n_tokens], finalize=False)
            prompt_frames = speaker["prompt_speech_feat"].size(1) if n_tokens == first else 0
            assert widths == [new.size(2) + prompt_frames] * flow.cfg.n_timesteps
    finally:
        hook.remove()


def test_incremental_refuses_calls_after_the_final_one(flow: FlowModel, case: dict, speaker: dict) -> None:
    renderer = _incremental(flow, speaker)
    renderer.render(case["tokens"][:, :10], finalize=True)
    with pytest.raises(RuntimeError):
        renderer.render(case["tokens"], finalize=True)
