"""The CosyVoice3 flow (CausalMaskedDiffWithDiT) against the official outputs (cases/flow.pt).

Everything is float32 on CPU. Per-layer values agree to float32 noise; the mel after 10 Euler
steps x `depth` blocks accumulates summation-order noise, hence MEL_TOL. A real defect (rotary
layout, chunk mask, modulation order, CFG sign) moves the mel by 1e-2 or more.
"""

from __future__ import annotations


import pytest
import torch

from tts_core.flow.dit_flow import DiTFlowModel
from tts_core.flow.sampler import time_span

LAYER_TOL = 1e-5
MEL_TOL = 1e-4


@pytest.fixture(scope="module")
def case(flow3_case: dict) -> dict:
    return flow3_case


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _render(flow3: DiTFlowModel, speaker3: dict, tokens: torch.Tensor, streaming: bool, finalize: bool):
    pt, pf = speaker3["flow_prompt_speech_token"], speaker3["prompt_speech_feat"]
    mel, _ = flow3.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                             torch.tensor([pf.size(1)]), speaker3["flow_embedding"], streaming=streaming,
                             finalize=finalize)
    return mel


def test_settings_from_the_directory(flow3: DiTFlowModel, case: dict, speaker3: dict) -> None:
    cfg = flow3.cfg
    assert (cfg.token_mel_ratio, cfg.pre_lookahead_len, cfg.estimator.static_chunk_size, cfg.n_timesteps) == (
        case["token_mel_ratio"], case["pre_lookahead_len"], case["static_chunk_size"], case["n_timesteps"])
    assert cfg.inference_cfg_rate == pytest.approx(case["inference_cfg_rate"])
    assert speaker3["flow_prompt_speech_token"].size(1) == case["n_prompt_tokens"]
    span = time_span(cfg.n_timesteps, cfg.t_scheduler, torch.device("cpu"), torch.float32)
    assert _diff(span, case["t_span"]) <= 1e-7
    head = case["rand_noise_head"]
    assert torch.equal(flow3.decoder.noise(head.size(2), torch.float32), head)


def test_pre_lookahead_output(flow3: DiTFlowModel, case: dict, speaker3: dict) -> None:
    tokens = torch.cat([speaker3["flow_prompt_speech_token"], case["tokens"]], dim=1)
    with torch.inference_mode():
        h = flow3.token_features(tokens, finalize=True)
    assert _diff(h, case["pre_lookahead_out"]) <= LAYER_TOL


def test_estimator_streaming_call_and_internals(flow3: DiTFlowModel, case: dict) -> None:
    call = case["estimator_call"]
    x, mask, mu, t, spks, cond = call["inputs"]
    est = flow3.decoder.estimator
    attn_mask = est.attention_mask(x.size(2), call["streaming_kwarg"], x.device)
    assert torch.equal(attn_mask.expand_as(call["attn_mask"][:, 0]), call["attn_mask"][:, 0])
    seen: dict[str, object] = {}
    hooks = [est.time_embed.register_forward_hook(lambda m, a, o: seen.__setitem__("time_embed", o)),
             est.input_embed.register_forward_hook(lambda m, a, o: seen.__setitem__("input_embed", o)),
             est.norm_out.register_forward_hook(lambda m, a, o: seen.__setitem__("norm_out", o))]
    hooks += [b.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(f"block{i}", o))
              for i, b in enumerate(est.transformer_blocks)]
    try:
        with torch.inference_mode():
            out = est(x, mask, mu, t, spks, cond, attn_mask)
    finally:
        for h in hooks:
            h.remove()
    for name in ("time_embed", "input_embed", "norm_out"):
        assert _diff(seen[name], call[name]) <= LAYER_TOL, name
    assert len(call["block_outputs"]) == len(est.transformer_blocks)
    for i, expected in enumerate(call["block_outputs"]):
        assert _diff(seen[f"block{i}"], expected) <= LAYER_TOL, i
    assert _diff(out, call["output"]) <= LAYER_TOL


def test_estimator_full_attention_call(flow3: DiTFlowModel, case: dict, speaker3: dict) -> None:
    """The first DiT call of the non-streaming render, inputs rebuilt as the README describes them."""
    call = case["estimator_call_nonstream"]
    frames = call["output"].size(2)
    x = case["rand_noise_head"][:, :, :frames].expand(2, -1, -1)
    mask = torch.ones(2, 1, frames)
    mu = torch.zeros(2, case["pre_lookahead_out"].size(2), frames)
    mu[0] = case["pre_lookahead_out"][0].repeat_interleave(case["token_mel_ratio"], dim=0).T
    cond = torch.zeros_like(mu)
    prompt = speaker3["prompt_speech_feat"][0].T
    cond[0, :, :prompt.size(1)] = prompt
    with torch.inference_mode():
        assert _diff(flow3.speaker(speaker3["flow_embedding"])[0], call["spks"][0]) <= LAYER_TOL
        out = flow3.decoder.estimator(x, mask, mu, torch.zeros(2), call["spks"], cond, None)
    assert _diff(out, call["output"]) <= LAYER_TOL


@pytest.mark.parametrize(("streaming", "key"), [(False, "mel_nonstream"), (True, "mel_stream_full")])
def test_mel_over_all_tokens(flow3: DiTFlowModel, case: dict, speaker3: dict, streaming: bool, key: str) -> None:
    mel = _render(flow3, speaker3, case["tokens"], streaming=streaming, finalize=True)
    assert _diff(mel, case[key]) <= MEL_TOL


def test_official_streaming_calls(flow3: DiTFlowModel, case: dict, speaker3: dict) -> None:
    """The calls `tts(stream=True)` made: chunk-masked passes, then a full-attention final one."""
    ratio = case["token_mel_ratio"]
    for call in case["stream_calls"]:
        mel = _render(flow3, speaker3, case["tokens"][:, :call["n_tokens"]], call["streaming"], call["finalize"])
        assert mel.size(2) == call["mel_frames_returned"]
        assert _diff(mel[:, :, ratio * call["token_offset"]:], call["mel_new"]) <= MEL_TOL
