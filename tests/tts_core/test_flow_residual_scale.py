"""The flow estimator's residual stream carried scaled down (tts_core/flow/residual_scale.py): the same
function in float32, and in float16 the tiny golden flow no longer overflows (it was NaN everywhere).
CPU: float16 convolutions and matmuls run there too, so CI checks the fix; the GPU's parity per dtype is
tests/tts_core/test_golden_dtypes_cuda.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tts_core.flow import FlowModel, load_flow
from tts_core.flow.residual_scale import FP16_RESIDUAL_SCALE, residual_scale_for, scale_residual_stream


def test_a_scaled_stream_computes_the_same_estimator_output(flow: FlowModel, flow_case: dict) -> None:
    estimator = copy.deepcopy(flow.decoder.estimator)
    scale_residual_stream(estimator, 1024.0)
    x, mask, mu, t, spks, cond = flow_case["estimator_inputs"]
    with torch.inference_mode():
        out = estimator(x, mask, mu, t, spks, cond, attn_mask=None)
    assert (out - flow_case["estimator_output"]).abs().max().item() <= 1e-4  # the golden float32 tolerance


def test_only_float16_scales_and_only_by_a_power_of_two_once(flow: FlowModel) -> None:
    assert residual_scale_for(torch.float16) == FP16_RESIDUAL_SCALE
    assert residual_scale_for(torch.bfloat16) == residual_scale_for(torch.float32) == 1.0
    estimator = copy.deepcopy(flow.decoder.estimator)
    with pytest.raises(ValueError, match="power of two"):
        scale_residual_stream(estimator, 1000.0)
    scale_residual_stream(estimator, 4.0)
    with pytest.raises(ValueError, match="already scaled"):
        scale_residual_stream(estimator, 4.0)


def test_the_golden_flow_in_float16_is_finite_and_close_to_float32(tiny_model_dir: Path, flow_case: dict,
                                                                  speaker: dict) -> None:
    flow16 = load_flow(tiny_model_dir, "cpu", torch.float16)
    assert flow16.decoder.estimator.residual_scale == FP16_RESIDUAL_SCALE
    tokens, pt, pf = flow_case["tokens"], speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"]
    mel, _ = flow16.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]),
                              pf.half(), torch.tensor([pf.size(1)]), speaker["flow_embedding"].half(),
                              streaming=False, finalize=True)
    assert torch.isfinite(mel).all()
    # 0.043 measured (magnitude ~25); unscaled, every value was NaN
    assert (mel.float() - flow_case["mel_nonstream"]).abs().max().item() <= 0.25
