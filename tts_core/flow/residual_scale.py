"""Carry the flow estimator's residual stream divided by a power of two, folded into its weights,
so that float16 does not overflow.

The estimator adds every resnet's and transformer block's output onto one residual stream, whose
magnitude grows level by level: in the tiny golden model it reaches ~9400 by the first mid block,
and the next block's convolution of it passes float16's 65504 (inf, then NaN from the LayerNorm on),
so every chunk was NaN. CosyVoice users report NaN from the flow in float16 with trained weights too.
Every use of the stream is linear (convolutions, the residual adds) or a LayerNorm, which ignores
scale when its epsilon scales with it, so the stream can be carried divided by `s`:

- the estimator's input is multiplied by 1/s (one elementwise op a step);
- layers that read the stream (resnets' first convolution and 1x1 shortcut, the down/up
  convolutions, the final block's convolution): biases / s, so their outputs stay at that scale;
- layers that add onto it from normalised, unscaled inputs (attention out, feed-forward out):
  weights and biases / s; a resnet's second block (conv -> LayerNorm -> Mish, nonlinear after the
  norm) has its output multiplied by 1/s (`branch_scale`, fused into the add when compiled);
- LayerNorms that read it: epsilon / s**2, the same normalised output.

The same function comes out. A power of two keeps the divisions exact except for weights pushed
below float16's normal range (2**-14), which lose bits. Applied in float32 before the model is
cast to float16; bf16 and float32 keep the scale 1 (nothing changes).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tts_core.flow.estimator import CausalBlock, CausalResnetBlock, FlowEstimator

# The tiny golden model's stream reaches ~6.6e5 unscaled (at 64 its up-level convolution still
# overflowed); at 1024, 4096 and 16384 the non-streaming golden mel was within 0.043-0.045 of
# float32's on the CPU (bf16: 0.31), so the weights pushed below float16's normal range cost nothing
# measurable. Trained weights keep their stream far lower.
FP16_RESIDUAL_SCALE = 1024.0


def residual_scale_for(dtype: torch.dtype) -> float:
    """The scale a flow in `dtype` carries its estimator's residual stream at."""
    return FP16_RESIDUAL_SCALE if dtype == torch.float16 else 1.0


@torch.no_grad()
def scale_residual_stream(estimator: FlowEstimator, scale: float) -> None:
    """Fold 1/`scale` into `estimator` (see the module docstring): once, in float32, before casting."""
    if scale == 1.0:
        return
    if scale <= 0 or 2.0 ** round(math.log2(scale)) != scale:
        raise ValueError(f"flow residual scale must be a power of two, got {scale}")
    if estimator.residual_scale != 1.0:
        raise ValueError("flow residual stream already scaled")
    s = float(scale)

    def reads_stream(layer: nn.Module) -> None:
        if layer.bias is not None:
            layer.bias.div_(s)

    def adds_to_stream(layer: nn.Linear) -> None:
        layer.weight.div_(s)
        if layer.bias is not None:
            layer.bias.div_(s)

    def reads_stream_block(block: CausalBlock) -> None:
        reads_stream(block.block[0])
        block.block[2].eps /= s * s

    for level in (*estimator.down_blocks, *estimator.mid_blocks, *estimator.up_blocks):
        resnet: CausalResnetBlock = level[0]
        reads_stream_block(resnet.block1)
        reads_stream(resnet.res_conv)
        resnet.branch_scale = 1.0 / s
        for block in level[1]:
            block.norm1.eps /= s * s
            block.norm3.eps /= s * s
            adds_to_stream(block.attn1.to_out[0])
            adds_to_stream(block.ff.net[2])
        if len(level) > 2:  # the down/up convolution after the transformer blocks
            reads_stream(level[2])
    reads_stream_block(estimator.final_block)
    estimator.residual_scale = s
