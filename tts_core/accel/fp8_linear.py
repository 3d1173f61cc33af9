"""FP8 (e4m3) weights for the speech LM's linear layers: optional, off by default.

Each weight matrix is quantized once, per output channel (one float32 scale per row, the row's
largest magnitude mapped to e4m3's largest finite value, 448). Activations are quantized the same
way per token at every call (dynamic scaling: no calibration data, and a loud token cannot clip
its quiet neighbours). `torch._scaled_mm` multiplies the e4m3 operands, accumulates in float32
and applies both scales, so the error is the two roundings to e4m3's 3 mantissa bits. How far that
moves the LM's token distribution from bf16 is measured by bench/bench_lm_precision.py.
On the H100 it is also slower than bf16: a lone first chunk's 28 decode steps took 51 ms against
42-46 (docs/PERF_NOTES.md). Per step it quantizes every
activation and calls `_scaled_mm` for a few rows; which of the two costs more is not profiled.

The same op runs on CPU (tests and agreement runs) and on CUDA devices of compute capability 8.9+
(Ada, Hopper), which have FP8 tensor cores; older GPUs are refused with a reason, never emulated.
Embeddings, norms and the speech head stay in the model dtype (SpeechTokenLM.convert_projections):
the head sets the sampling distribution and is 1 % of the weights.

This module owns the quantized tensors; the model's own parameters are untouched, so its state
dict is still the checkpoint's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tts_core.llm.speech_lm import SpeechTokenLM

E4M3 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(E4M3).max
MIN_CUDA_CAPABILITY = (8, 9)


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why FP8 matmuls cannot run on `device`, or None when they can."""
    device = torch.device(device)
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return f"FP8 matmuls need a CUDA device of compute capability 8.9+ or the CPU, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CUDA_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} has compute capability {capability[0]}.{capability[1]}; "
                "FP8 tensor cores need 8.9+ (Ada, Hopper)")
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> (e4m3 (M, K), float32 scales (M, 1)) with x ~= e4m3 * scale, row by row."""
    x32 = x.float()
    scale = x32.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (x32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Projection:
    """x @ weight.T + bias with `weight` held in e4m3 (built from the model's weight, which it does
    not keep). Results come back in the input's dtype."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        out_features, in_features = weight.shape
        if weight.is_cuda and (out_features % 16 or in_features % 16):
            raise ValueError(f"FP8 matmul needs both weight dims divisible by 16 on CUDA, got {tuple(weight.shape)}")
        quantized, scale = quantize_rows(weight.detach())
        self.weight = quantized  # (N, K) row-major: its .t() is the column-major operand _scaled_mm wants
        self.weight_scale = scale.reshape(1, out_features)
        self.bias = None if bias is None else bias.detach()
        self.out_features = out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_scale = quantize_rows(x.reshape(-1, x.shape[-1]))
        # Row-wise scaled FP8 GEMMs on CUDA write bf16 only; the CPU kernel writes any float dtype.
        out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
        out = torch._scaled_mm(rows, self.weight.t(), scale_a=row_scale, scale_b=self.weight_scale,
                               out_dtype=out_dtype).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)


@dataclass(frozen=True)
class Fp8Summary:
    projections: int
    dense_bytes: int  # the replaced weights in the model dtype
    fp8_bytes: int  # the same weights in e4m3, scales included


def use_fp8_projections(lm: SpeechTokenLM) -> Fp8Summary:
    """Switch the LM's decoder-layer projections to FP8 (once, after loading and moving the model)."""
    reason = fp8_unsupported_reason(lm.llm_decoder.weight.device)
    if reason is not None:
        raise ValueError(reason)
    made: list[tuple[torch.Tensor, Fp8Projection]] = []

    def make(weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Projection:
        projection = Fp8Projection(weight, bias)
        made.append((weight, projection))
        return projection

    lm.convert_projections(make)
    return Fp8Summary(
        projections=len(made),
        dense_bytes=sum(w.numel() * w.element_size() for w, _ in made),
        fp8_bytes=sum(p.weight.numel() + 4 * p.weight_scale.numel() for _, p in made))
