"""FP8 LM weights (tts_core/accel/fp8_linear.py) on CPU: torch's CPU `_scaled_mm` is the same op the
GPU path runs, so quantization, scaling and the model wiring are checked here; agreement on the
full-size model is measured by bench/bench_lm_precision.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.accel.fp8_linear import (
    E4M3_MAX,
    Fp8Projection,
    fp8_unsupported_reason,
    quantize_rows,
    use_fp8_projections,
)
from tts_core.model_dir import load_speech_lm

E4M3_STEP = 2.0**-3  # e4m3 keeps 3 mantissa bits: a value rounds within half a step, relative


def test_rows_are_scaled_to_the_e4m3_range_and_round_trip() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 64, generator=gen) * torch.tensor([1e-3, 1.0, 50.0, 1e4, 3.0, 0.2])[:, None]
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (6, 1)
    assert torch.equal(q.float().abs().amax(dim=-1), torch.full((6,), E4M3_MAX))  # each row uses the full range
    back = q.float() * scale
    big = x.abs() > x.abs().amax(dim=-1, keepdim=True) / 64  # values above e4m3's subnormals round relatively
    assert ((back - x).abs() <= x.abs() * E4M3_STEP / 2 + 1e-12)[big].all()


def test_a_projection_matches_the_dense_matmul_within_e4m3_rounding() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(96, 128, generator=gen) / 128**0.5
    bias = torch.randn(96, generator=gen)
    x = torch.randn(2, 5, 128, generator=gen)
    exact = torch.nn.functional.linear(x, weight, bias)
    got = Fp8Projection(weight, bias)(x)
    assert got.shape == exact.shape and got.dtype == x.dtype
    error = float((got - exact).norm() / (exact - bias).norm())
    # Two roundings of ~2 % rms each, averaged over 128 products: a few %. A dropped scale or bias
    # would be off by orders of magnitude; an unquantized path would be exact.
    assert 1e-3 < error < 0.06


@pytest.fixture()
def lm_and_input(tiny_model_dir: Path, golden_dir: Path):
    torch.set_num_threads(1)
    case = torch.load(golden_dir / "cases" / "llm.pt", weights_only=False)
    lm = load_speech_lm(tiny_model_dir)
    return lm, lm.build_prefill_input(case["text_token"], case["prompt_text_token"], case["prompt_speech_token"])


def test_fp8_weights_keep_the_lm_distribution_and_the_checkpoint(lm_and_input) -> None:
    lm, lm_input = lm_and_input
    reference = lm.teacher_forced_logp(lm_input)
    state = {k: v.clone() for k, v in lm.state_dict().items()}
    summary = use_fp8_projections(lm)
    layers = lm.llm.config.num_hidden_layers
    assert summary.projections == 4 * layers  # q/k/v fused, o, gate/up fused, down
    assert summary.fp8_bytes < summary.dense_bytes / 3  # 1 byte per float32 weight, plus a scale per row
    after = lm.state_dict()
    assert after.keys() == state.keys() and all(torch.equal(after[k], v) for k, v in state.items())
    got = lm.teacher_forced_logp(lm_input)
    kl = (reference.exp() * (reference - got)).sum(-1)
    agree = (reference.argmax(-1) == got.argmax(-1)).float().mean()
    assert float((got - reference).abs().max()) > 1e-3  # the projections really run in FP8
    assert float(kl.mean()) < 0.03 and float(agree) > 0.75
    with pytest.raises(RuntimeError, match="converted already"):
        use_fp8_projections(lm)


def test_fp8_decode_steps_continue_the_prefill_like_a_teacher_forced_pass(lm_and_input) -> None:
    lm, lm_input = lm_and_input
    use_fp8_projections(lm)
    tokens = [5, 77, 300]
    speech = lm.speech_embedding(torch.tensor(tokens))
    expected = lm.teacher_forced_logp(torch.cat([lm_input, speech]))[lm_input.shape[0] - 1:]
    lm.setup_cache(2, lm_input.shape[0] + 8)
    steps = [lm.prefill([1], [lm_input])[0]]
    steps += [lm.decode_step([1], [t])[0] for t in tokens]
    # Per-token activation scales make each row's result independent of how rows are batched.
    assert torch.allclose(torch.stack(steps), expected, atol=1e-4)


def test_devices_without_fp8_matmuls_are_refused_with_a_reason() -> None:
    assert fp8_unsupported_reason("cpu") is None
    assert "CUDA device" in fp8_unsupported_reason("meta")
