"""The HiFT building blocks that carry weights: Snake activation and the dilated residual block.

Attribute names (`convs1`, `convs2`, `activations1`, `activations2`, `alpha`) are the official
state-dict names. Convolutions are weight-normed with PyTorch's parametrization API so checkpoint
keys read `...parametrizations.weight.original0/1`; `fold_weight_norm` in `generator.py` removes
the parametrizations after loading.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

# Guards 1/alpha for an alpha trained to ~0; the official Snake adds the same epsilon.
_ALPHA_EPS = 1e-9
# Upstream caps 1/alpha just under the fp16 maximum so a half-precision engine cannot overflow;
# for alpha above 1.7e-5 (every channel of the released checkpoints but a handful) it changes nothing.
_INV_ALPHA_MAX = 6e4


class Snake(nn.Module):
    """x + sin^2(alpha x) / alpha, one alpha per channel (linear scale, as HiFT uses it)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha = self.alpha[None, :, None]
        inv_alpha = torch.clamp(1.0 / (alpha + _ALPHA_EPS), max=_INV_ALPHA_MAX)
        return x + inv_alpha * torch.sin(x * alpha).pow(2)


def wn_conv1d(in_ch: int, out_ch: int, kernel: int, stride: int = 1, dilation: int = 1,
              padding: int = 0) -> nn.Conv1d:
    return weight_norm(nn.Conv1d(in_ch, out_ch, kernel, stride, dilation=dilation, padding=padding))


def same_padding(kernel: int, dilation: int) -> int:
    return (kernel * dilation - dilation) // 2


def same_padded_conv(channels: int, kernel: int, dilation: int) -> nn.Module:
    return wn_conv1d(channels, channels, kernel, dilation=dilation, padding=same_padding(kernel, dilation))


ConvFactory = Callable[[int, int, int], nn.Module]  # (channels, kernel, dilation) -> weight-normed conv


class ResBlock(nn.Module):
    """Three (Snake, dilated conv, Snake, conv) branches applied as successive residuals. `conv` builds
    each convolution: centred ("same") padding for CosyVoice2, left-causal for CosyVoice3."""

    def __init__(self, channels: int, kernel: int, dilations: tuple[int, ...],
                 conv: ConvFactory = same_padded_conv) -> None:
        super().__init__()
        self.convs1 = nn.ModuleList(conv(channels, kernel, d) for d in dilations)
        self.convs2 = nn.ModuleList(conv(channels, kernel, 1) for _ in dilations)
        self.activations1 = nn.ModuleList(Snake(channels) for _ in dilations)
        self.activations2 = nn.ModuleList(Snake(channels) for _ in dilations)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for act1, conv1, act2, conv2 in zip(self.activations1, self.convs1, self.activations2, self.convs2):
            x = x + conv2(act2(conv1(act1(x))))
        return x
