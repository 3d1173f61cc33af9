"""The causal convolutions of CosyVoice3's HiFT: each output sample depends on the past, plus a fixed,
declared number of future frames where the official model looks ahead (conv_pre, the F0 predictor's
first layer). Weight-normed like the rest of HiFT, so keys read `...parametrizations.weight.original0/1`.

A look-ahead convolution is given its future frames explicitly (`context`) in a non-final streaming
call and zeros at the end of the utterance; everything else is left-padded with zeros.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.nn.utils.parametrizations import weight_norm

from tts_core.hift.layers import ResBlock


class CausalConv1d(nn.Conv1d):
    """Stride-1 conv padded on one side: `look_ahead=False` pads dilation*(kernel-1) on the left (past
    only); `look_ahead=True` sees kernel-1 future frames, zero-padded or taken from `context`."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, dilation: int = 1, look_ahead: bool = False) -> None:
        super().__init__(in_ch, out_ch, kernel, dilation=dilation)
        self.look_ahead = look_ahead
        self.pad = dilation * (kernel - 1)

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if not self.look_ahead:
            return super().forward(F.pad(x, (self.pad, 0)))
        if context is None:
            return super().forward(F.pad(x, (0, self.pad)))
        if context.size(2) != self.pad:
            raise ValueError(f"look-ahead context must be {self.pad} frames, got {context.size(2)}")
        return super().forward(torch.cat([x, context], dim=2))


class CausalUpsampleConv(nn.Conv1d):
    """Nearest-neighbour repeat by `stride`, then a left-padded conv (replaces the transposed conv)."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int) -> None:
        super().__init__(in_ch, out_ch, kernel)
        self.stride_up = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.repeat_interleave(self.stride_up, dim=2)
        return super().forward(F.pad(x, (self.kernel_size[0] - 1, 0)))


class CausalDownsampleConv(nn.Conv1d):
    """Strided conv left-padded by stride-1, so output frame i covers input frames up to its own."""

    def __init__(self, in_ch: int, out_ch: int, kernel: int, stride: int) -> None:
        super().__init__(in_ch, out_ch, kernel, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(F.pad(x, (self.stride[0] - 1, 0)))


def causal_resblock(channels: int, kernel: int, dilations: tuple[int, ...]) -> ResBlock:
    """HiFT's dilated residual block with left-causal convolutions (official names convs1/convs2/...)."""
    return ResBlock(channels, kernel, dilations,
                    conv=lambda ch, k, d: weight_norm(CausalConv1d(ch, ch, k, dilation=d)))


class CausalF0Predictor(nn.Module):
    """Mel -> F0 (Hz per frame): first conv sees `look_ahead` future frames, four left-causal convs,
    ELU after each, a linear head, abs. Keys as the official CausalConvRNNF0Predictor."""

    def __init__(self, in_channels: int, cond_channels: int, look_ahead: int = 3, num_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = [weight_norm(CausalConv1d(in_channels, cond_channels, look_ahead + 1,
                                                            look_ahead=True)), nn.ELU()]
        for _ in range(num_layers - 1):
            layers += [weight_norm(CausalConv1d(cond_channels, cond_channels, 3)), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)
        self.look_ahead = look_ahead

    def forward(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel (B, 80, T) -> f0 (B, T), or (B, T - look_ahead) when not final (the last frames are
        look-ahead only)."""
        first = self.condnet[0]
        if finalize:
            h = first(mel)
        else:
            h = first(mel[:, :, :-self.look_ahead], mel[:, :, -self.look_ahead:])
        for layer in list(self.condnet)[1:]:
            h = layer(h)
        return self.classifier(h.transpose(1, 2)).squeeze(-1).abs()
