"""tts_core.flow.stepped: rows that join at different Euler steps each get their own call's output.

Three streams' first chunks join the stepper three and four steps apart, so most steps run rows at
three different steps, in a bucket with padding rows, and rows are compacted as each leaves. Each
must equal the official streaming call (golden), and so must the stream's later chunks, rendered
by ordinary pooled calls from the frames and convolution states the stepper kept: each row must
have written them into its own step's memory.
"""

from __future__ import annotations

import pytest
import torch

from tts_core.flow import FlowModel
from tts_core.flow.context_pool import PoolShape
from tts_core.flow.encoder_window import encode_grouped
from tts_core.flow.pooled import PooledFlow
from tts_core.flow.stepped import SteppedFlow

TOL = 1e-4


def _pooled(flow: FlowModel, speaker: dict):
    pooled = PooledFlow(flow, PoolShape(stream_slots=3, stream_frames=400, voice_slots=1, voice_frames=100,
                                        prompt_frames=200))
    voice = pooled.register_voice(speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"],
                                  speaker["flow_embedding"])
    return pooled, voice


def _join(pooled: PooledFlow, stepped: SteppedFlow, stream, tokens: torch.Tensor) -> None:
    plan = pooled.plan(stream, tokens, False)
    stepped.join(stream, stream, plan, encode_grouped(pooled.model, [plan])[0])


def test_rows_at_different_steps_match_the_official_streaming_calls(flow: FlowModel, flow_case: dict,
                                                                    speaker: dict) -> None:
    tokens = flow_case["tokens"]
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    pooled, voice = _pooled(flow, speaker)
    probe = pooled.open_stream(voice)
    plan_frames = pooled.plan(probe, tokens[:, :first], False).new_frames
    pooled.close_stream(probe)
    stepped = SteppedFlow(pooled, rows=4, ctx_cap=voice.prefix_frames, new_cap=plan_frames + 16)
    stepped.runners[4] = lambda: stepped.advance(4)  # every step in a bucket of 4: padding rows
    streams = [pooled.open_stream(voice) for _ in range(3)]
    joins = {0: streams[0], 3: streams[1], 7: streams[2]}
    firsts: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for at in range(30):
            if at in joins:
                _join(pooled, stepped, joins[at], tokens[:, :first])
            for row, mel in stepped.step():
                firsts[id(row.key)] = pooled.finish(row.stream, row.plan, mel)
            if len(firsts) == 3:
                break
    assert not stepped.rows
    assert at == 7 + 9  # the last row joined at 7 and took its tenth step there
    expected = flow_case["mel_stream_first"]
    for s in streams:
        mel = firsts[id(s)]
        assert mel.shape == expected.shape
        assert (mel - expected).abs().max().item() <= TOL
    # The later chunks read what the stepper kept: the first chunk's frames and conv states.
    done = expected.size(2)
    second = first + flow_case["hop"]
    for key, n_tokens, finalize in (("mel_stream_second", second, False),
                                    ("mel_stream_final", tokens.size(1), True)):
        outs = pooled.render(streams, [tokens[:, :n_tokens]] * 3, [finalize] * 3)
        want = flow_case[key][:, :, done:]
        for out in outs:
            assert out.shape == want.shape
            assert (out - want).abs().max().item() <= TOL, key
        done = flow_case[key].size(2)


def test_a_row_that_does_not_fit_is_refused_and_a_row_can_be_dropped(flow: FlowModel, flow_case: dict,
                                                                  speaker: dict) -> None:
    tokens = flow_case["tokens"]
    first = flow_case["first_hop"] + flow_case["pre_lookahead_len"]
    pooled, voice = _pooled(flow, speaker)
    a, b = pooled.open_stream(voice), pooled.open_stream(voice)
    plan = pooled.plan(a, tokens[:, :first], False)
    narrow = SteppedFlow(pooled, rows=1, ctx_cap=voice.prefix_frames, new_cap=plan.new_frames - 1)
    with pytest.raises(ValueError, match="no room for a row"):
        _join(pooled, narrow, a, tokens[:, :first])
    one = SteppedFlow(pooled, rows=1, ctx_cap=voice.prefix_frames, new_cap=plan.new_frames)
    with torch.inference_mode():
        _join(pooled, one, a, tokens[:, :first])
        with pytest.raises(ValueError, match="1/1 rows"):
            _join(pooled, one, b, tokens[:, :first])
        one.step()
        assert one.drop(lambda key: key is b) == []
        assert [r.key for r in one.drop(lambda key: key is a)] == [a] and one.free == 1
        assert one.step() == []
