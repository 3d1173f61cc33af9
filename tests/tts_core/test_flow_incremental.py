"""tts_core.flow.incremental: chunk-wise rendering equals the official full re-run, at constant work.

Tolerance 1e-4 max abs (values reach ~25), as in test_golden_flow: the chunk-wise path multiplies
the same numbers in differently shaped matmuls, so it differs from the full re-run by float32
rounding only (measured <= 3e-5 against the golden, <= 2e-5 against our own full re-run).
"""

from __future__ import annotations

import pytest
import torch

from tts_core.flow import FlowModel
from tts_core.flow.incremental import IncrementalFlow
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule

TOL = 1e-4


def _incremental(flow: FlowModel, speaker: dict) -> IncrementalFlow:
    return IncrementalFlow(flow, speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"],
                           speaker["flow_embedding"])


def test_golden_incremental_matches_official_streaming_calls(flow: FlowModel, flow_case: dict, speaker: dict) -> None:
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    calls = [("mel_stream_first", first, False), ("mel_stream_second", first + flow_case["hop"], False),
             ("mel_stream_final", flow_case["tokens"].size(1), True)]
    renderer = _incremental(flow, speaker)
    done = 0
    for key, n_tokens, finalize in calls:
        new = renderer.render(flow_case["tokens"][:, :n_tokens], finalize)
        expected = flow_case[key][:, :, done:]  # the official caller keeps only the frames it has not played
        assert new.shape == expected.shape
        assert (new - expected).abs().max().item() <= TOL, key
        done = flow_case[key].size(2)


def test_parity_incremental_calls_ending_inside_a_chunk(flow: FlowModel, flow_case: dict, speaker: dict,
                                                        official_call) -> None:
    # Ends at 20 and 41 tokens are not chunk boundaries: the unfinished chunk is re-rendered next call.
    tokens = flow_case["tokens"]
    renderer = _incremental(flow, speaker)
    done = 0
    for n_tokens, finalize in ((20, False), (41, False), (tokens.size(1), True)):
        new = renderer.render(tokens[:, :n_tokens], finalize)
        expected = official_call(tokens[:, :n_tokens], finalize)[:, :, done:]
        assert new.shape == expected.shape
        assert (new - expected).abs().max().item() <= TOL, n_tokens
        done += new.size(2)


def test_incremental_estimator_sees_only_new_frames_on_aligned_calls(flow: FlowModel, flow_case: dict,
                                                                      speaker: dict) -> None:
    widths: list[int] = []
    hook = flow.decoder.estimator.register_forward_pre_hook(lambda _m, args: widths.append(args[0].size(2)))
    try:
        renderer = _incremental(flow, speaker)
        first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
        for n_tokens in (first, first + flow_case["hop"]):
            widths.clear()
            new = renderer.render(flow_case["tokens"][:, :n_tokens], finalize=False)
            prompt_frames = speaker["prompt_speech_feat"].size(1) if n_tokens == first else 0
            assert widths == [new.size(2) + prompt_frames] * flow.cfg.n_timesteps
    finally:
        hook.remove()


def test_incremental_refuses_calls_after_the_final_one(flow: FlowModel, flow_case: dict, speaker: dict) -> None:
    renderer = _incremental(flow, speaker)
    renderer.render(flow_case["tokens"][:, :10], finalize=True)
    with pytest.raises(RuntimeError):
        renderer.render(flow_case["tokens"], finalize=True)


def _streamed(flow: FlowModel, speaker: dict, tokens: torch.Tensor, schedule: ChunkSchedule) -> list[torch.Tensor]:
    """Each chunk's new frames as the schedule renders `tokens` arriving one by one."""
    renderer, chunks = _incremental(flow, speaker), []
    planner = ChunkPlanner(schedule, speaker["flow_prompt_speech_token"].size(1))
    for have in range(1, tokens.size(1) + 1):
        while (task := planner.next_chunk(have, lm_finished=have == tokens.size(1))) is not None:
            chunks.append(renderer.render(tokens[:, :task.token_end], task.finalize))
    return chunks


@pytest.mark.parametrize("first_hop", [8, 10, 15])
def test_a_shorter_first_hop_changes_only_the_first_chunk(flow: FlowModel, flow_case: dict, speaker: dict,
                                                          first_hop: int) -> None:
    """`first_hop_tokens`: the first chunk ends inside an attention chunk, so its frames differ from the
    official schedule's; every frame after it is the official schedule's (the second chunk ends on the grid)."""
    tokens = flow_case["tokens"]
    official = torch.cat(_streamed(flow, speaker, tokens, ChunkSchedule()), dim=2)
    short = _streamed(flow, speaker, tokens, ChunkSchedule(first_hop_tokens=first_hop))
    first = short[0].size(2)
    assert first == first_hop * flow.cfg.token_mel_ratio
    assert (short[0] - official[:, :, :first]).abs().max().item() > 10 * TOL
    later = torch.cat(short[1:], dim=2)
    assert later.shape == official[:, :, first:].shape
    assert (later - official[:, :, first:]).abs().max().item() <= TOL
