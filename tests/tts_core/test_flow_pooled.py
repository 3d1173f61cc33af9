"""tts_core.flow.pooled: many streams rendered from one context pool equal the official streaming calls.

The golden streaming mels (official implementation) are the reference: each frame is computed once
from the pooled context, so the output must match within 1e-4 (float32 rounding of differently
shaped matmuls, as in test_golden_flow), also when streams of different lengths, a stream's first
call and another's final call share one padded batch, and when the voice prompt's shared frames
come from the voice's slot rather than being recomputed.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.flow import FlowModel, load_flow
from tts_core.flow.context_pool import PoolShape
from tts_core.flow.pooled import PooledFlow

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


def _pooled(flow: FlowModel, speaker: dict, stream_frames: int = 400, encoder_tokens: int | None = None):
    pooled = PooledFlow(flow, PoolShape(stream_slots=3, stream_frames=stream_frames, voice_slots=2,
                                        voice_frames=100, prompt_frames=200), encoder_tokens)
    voice = pooled.register_voice(speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"],
                                  speaker["flow_embedding"])
    return pooled, voice


def _official(flow: FlowModel, speaker: dict, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
    pt, pf = speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"]
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), speaker["flow_embedding"], streaming=True, finalize=finalize)
    return mel


def test_golden_pooled_streams_match_official_streaming_calls(flow: FlowModel, case: dict, speaker: dict) -> None:
    pooled, voice = _pooled(flow, speaker)
    assert voice.prefix_frames == 50  # 50 prompt tokens: the first chunk is shared, the second is not
    streams = [pooled.open_stream(voice), pooled.open_stream(voice)]
    first = case["first_hop"] + case["pre_lookahead_len"]
    calls = [("mel_stream_first", first, False), ("mel_stream_second", first + case["hop"], False),
             ("mel_stream_final", case["tokens"].size(1), True)]
    done = 0
    for key, n_tokens, finalize in calls:
        outs = pooled.render(streams, [case["tokens"][:, :n_tokens]] * 2, [finalize] * 2)
        expected = case[key][:, :, done:]  # the official caller plays only the frames it has not played
        for new in outs:
            assert new.shape == expected.shape
            assert (new - expected).abs().max().item() <= TOL, key
        done = case[key].size(2)


def test_parity_streams_at_different_lengths_share_one_batch(flow: FlowModel, case: dict, speaker: dict) -> None:
    # Stream A ends calls inside chunks (20, 41 tokens: the unfinished chunk is re-rendered next
    # call, exactly as the official re-run does); stream B is a chunk behind; C joins late, so its
    # first call shares a batch with A's final one.
    tokens = case["tokens"]
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
    full = _official(flow, speaker, tokens, True)
    for name, parts in heard.items():
        mel = torch.cat(parts, dim=2)
        assert mel.shape == full.shape, name
        # Frames of a call that ends inside a chunk are what the official call of that length gives.
        ref = {"a": [_official(flow, speaker, tokens[:, :20], False), _official(flow, speaker, tokens[:, :41], False)],
               "b": [_official(flow, speaker, tokens[:, :28], False), _official(flow, speaker, tokens[:, :53], False)],
               "c": [_official(flow, speaker, tokens[:, :28], False)]}[name]
        expected, done = [], 0
        for r in ref:
            expected.append(r[:, :, done:])
            done = r.size(2)
        expected.append(full[:, :, done:])
        assert (mel - torch.cat(expected, dim=2)).abs().max().item() <= TOL, name


def test_slots_are_reused_and_a_closed_stream_cannot_render(flow: FlowModel, case: dict, speaker: dict) -> None:
    pooled, voice = _pooled(flow, speaker)
    s = pooled.open_stream(voice)
    pooled.render([s], [case["tokens"]], [True])
    pooled.close_stream(s)
    pooled.close_stream(s)  # idempotent
    assert pooled.pool.free_streams == 3
    with pytest.raises(RuntimeError):
        pooled.render([s], [case["tokens"]], [True])
    # A stream in a reused slot is not disturbed by what the slot held before.
    again = pooled.open_stream(voice)
    first = case["first_hop"] + case["pre_lookahead_len"]
    out = pooled.render([again], [case["tokens"][:, :first]], [False])[0]
    assert (out - case["mel_stream_first"]).abs().max().item() <= TOL


def test_a_stream_longer_than_its_ring_keeps_its_latest_chunks(flow: FlowModel, case: dict, speaker: dict) -> None:
    # 50 own frames per slot: later calls see the voice prefix plus the latest chunk only.
    tokens = case["tokens"]
    pooled, voice = _pooled(flow, speaker, stream_frames=50)
    s = pooled.open_stream(voice)
    outs = [pooled.render([s], [tokens[:, :n]], [False])[0] for n in (28, 53, 78)]
    outs.append(pooled.render([s], [tokens], [True])[0])
    mel = torch.cat(outs, dim=2)
    full = _official(flow, speaker, tokens, True)
    assert mel.shape == full.shape and torch.isfinite(mel).all()
    assert s.slid
    # The first two calls (context within the ring) are still exact.
    assert (outs[0] - case["mel_stream_first"]).abs().max().item() <= TOL
