"""The neural-source-filter excitation: F0 -> harmonics plus noise -> one source waveform.

Voiced samples (F0 above the threshold) get `nb_harmonics + 1` sines at k*F0 with a random start
phase per overtone (the fundamental starts at phase 0) plus faint noise; unvoiced samples get noise
only. A learned linear mix and tanh fold the harmonics into one channel. All randomness is drawn
from the `torch.Generator` passed in, never from the global RNG, so concurrent requests cannot
disturb each other's draws and a seeded request replays exactly.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class HarmonicSource(nn.Module):
    """Keys as the official `m_source` (SourceModuleHnNSF): only `l_linear` carries weights."""

    def __init__(self, sampling_rate: int, nb_harmonics: int, sine_amp: float, noise_std: float,
                 voiced_threshold: float) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)
        self.register_buffer("overtones", torch.arange(1, nb_harmonics + 2, dtype=torch.float32)[None, :, None],
                             persistent=False)

    def forward(self, f0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """f0 (B, 1, L) in Hz at the audio rate -> source (B, 1, L)."""
        batch, _, length = f0.shape
        n = self.overtones.shape[1]
        # Phase is accumulated in cycles and wrapped before scaling to radians, as upstream does, so
        # float32 keeps its precision over long utterances.
        cycles = torch.cumsum(f0 * self.overtones.to(f0.dtype) / self.sampling_rate, dim=-1) % 1
        theta = 2 * math.pi * cycles
        start = torch.rand((batch, n, 1), generator=generator, dtype=f0.dtype, device=f0.device)
        start = start * (2 * math.pi) - math.pi
        start[:, 0] = 0
        sines = self.sine_amp * torch.sin(theta + start)

        voiced = (f0 > self.voiced_threshold).to(f0.dtype)
        # Unvoiced noise is scaled so its peaks stay near the sine amplitude (std = amp / 3).
        noise_amp = voiced * self.noise_std + (1 - voiced) * (self.sine_amp / 3)
        noise = noise_amp * torch.randn(sines.shape, generator=generator, dtype=f0.dtype, device=f0.device)
        harmonics = sines * voiced + noise
        return torch.tanh(self.l_linear(harmonics.transpose(1, 2))).transpose(1, 2)
