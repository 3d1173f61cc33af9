"""Mel -> F0 (Hz per mel frame): the official ConvRNNF0Predictor (five conv+ELU layers, linear head)."""

from __future__ import annotations

import torch
from torch import nn

from tts_core.hift.layers import wn_conv1d


class F0Predictor(nn.Module):
    def __init__(self, in_channels: int, cond_channels: int, num_layers: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(num_layers):
            # Interleaved ELUs keep the official Sequential indices (condnet.0, .2, .4, ...).
            layers += [wn_conv1d(in_channels if i == 0 else cond_channels, cond_channels, 3, padding=1), nn.ELU()]
        self.condnet = nn.Sequential(*layers)
        self.classifier = nn.Linear(cond_channels, 1)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) -> f0 (B, T), non-negative."""
        hidden = self.condnet(mel).transpose(1, 2)
        return self.classifier(hidden).squeeze(-1).abs()
