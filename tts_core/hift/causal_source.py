"""CosyVoice3's deterministic NSF excitation (the official SineGen2 in causal mode + SourceModuleHnNSF).

No random number is drawn at inference: the initial phase per harmonic and the additive noise come
from two fixed buffers that the official code draws from PyTorch's global generator while the model
is built (`official_source_noise` reproduces that recipe). The noise is uniform in [0, 1), not
Gaussian, and the buffers cap an utterance at 300 s. Because the source is a pure function of F0, a
streaming call over a prefix of the mel yields a prefix of the same source.

Phase: per-sample phase increments (f0 k / sr, wrapped) are averaged down to the frame rate, summed,
and repeated back to the sample rate ("nearest"; CosyVoice2's SineGen2 interpolates linearly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

NOISE_SECONDS = 300
NOISE_RATE = 24000


@dataclass(frozen=True)
class NoiseRecipe:
    """The sizes of what the official model builds between seeding and drawing the source noise; each
    construction consumes its default initialisation's draws, so every size moves the noise."""

    f0_cond_channels: int
    f0_in_channels: int = 80
    harmonics: int = 9
    mel_bins: int = 80  # the flow's noise buffer (mel_bins, 50 x 300 frames)
    flow_vocab_size: int = 6561
    flow_input_size: int = 80
    spk_embed_dim: int = 192


def official_source_noise(recipe: NoiseRecipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(rand_ini (1, harmonics), sine_noise (1, 300 s x 24 kHz, harmonics)) as the official model draws
    them from the global generator seeded with 0 in CausalConditionalCFM.__init__, after the draws of
    the modules built in between. The caller's RNG state is kept."""
    r = recipe
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        torch.randn(1, r.mel_bins, 50 * NOISE_SECONDS)  # the flow's noise buffer
        nn.Embedding(r.flow_vocab_size, r.flow_input_size)  # flow.input_embedding
        nn.Linear(r.spk_embed_dim, r.mel_bins)  # flow.spk_embed_affine_layer
        nn.Conv1d(r.f0_in_channels, r.f0_cond_channels, 4)  # the F0 predictor's layers
        for _ in range(4):
            nn.Conv1d(r.f0_cond_channels, r.f0_cond_channels, 3)
        nn.Linear(r.f0_cond_channels, 1)
        rand_ini = torch.rand(1, r.harmonics)
        rand_ini[:, 0] = 0
        sine_noise = torch.rand(1, NOISE_SECONDS * NOISE_RATE, r.harmonics)
    return rand_ini, sine_noise


class CausalHarmonicSource(nn.Module):
    """Keys as the official `m_source`: only `l_linear` carries weights."""

    def __init__(self, sampling_rate: int, samples_per_frame: int, nb_harmonics: int, sine_amp: float,
                 noise_std: float, voiced_threshold: float, recipe: NoiseRecipe) -> None:
        super().__init__()
        self.sampling_rate = sampling_rate
        self.samples_per_frame = samples_per_frame
        self.sine_amp = sine_amp
        self.noise_std = noise_std
        self.voiced_threshold = voiced_threshold
        self.l_linear = nn.Linear(nb_harmonics + 1, 1)
        if recipe.harmonics != nb_harmonics + 1:
            raise ValueError(f"hift: noise recipe for {recipe.harmonics} harmonics, model has {nb_harmonics + 1}")
        rand_ini, sine_noise = official_source_noise(recipe)
        self.register_buffer("rand_ini", rand_ini, persistent=False)
        self.register_buffer("sine_noise", sine_noise, persistent=False)

    def forward(self, f0: torch.Tensor) -> torch.Tensor:
        """f0 per frame (B, T) -> source (B, 1, T * samples_per_frame)."""
        return self.from_cycles(f0, torch.cumsum(self.increments(f0), dim=2), 0)

    def increments(self, f0: torch.Tensor, start_frame: int = 0) -> torch.Tensor:
        """Each harmonic's phase increment in cycles over every frame (B, H, T) of frames [start_frame,
        start_frame + T): frame-local (the linear downsampling reads two samples inside the frame), so a
        stream can keep them and sum them again; their running sum (`torch.cumsum` over dim 2, from the
        utterance start) is the phase."""
        per_sample = f0[:, :, None].repeat_interleave(self.samples_per_frame, dim=1)  # (B, L, 1)
        overtones = torch.arange(1, self.l_linear.in_features + 1, dtype=f0.dtype, device=f0.device)
        increments = (per_sample * overtones / self.sampling_rate) % 1
        if start_frame == 0:
            increments[:, 0, :] = increments[:, 0, :] + self.rand_ini.to(increments.dtype)
        return F.interpolate(increments.transpose(1, 2), scale_factor=1 / self.samples_per_frame, mode="linear")

    def from_cycles(self, f0: torch.Tensor, cycles: torch.Tensor, start_frame: int | Sequence[int]) -> torch.Tensor:
        """The source of frames [start_frame, start_frame + T) (B, 1, T * samples_per_frame) from their f0
        (B, T) and phase in cycles (B, H, T: the running sum of `increments`); the additive noise is the
        fixed buffer's at those samples. `start_frame` per row (B of them) where the rows are different
        streams' windows (the batched vocoder)."""
        spf = self.samples_per_frame
        per_sample = f0[:, :, None].repeat_interleave(spf, dim=1)  # (B, L, 1)
        starts = [start_frame] if isinstance(start_frame, int) else list(start_frame)
        length = per_sample.size(1)
        if max(starts) * spf + length > self.sine_noise.size(1):
            raise ValueError(f"hift: {max(starts) * spf + length} samples exceed the "
                             f"{self.sine_noise.size(1)}-sample noise buffer")
        noise = torch.cat([self.sine_noise[:, s * spf:s * spf + length] for s in starts])  # (B, L, H)
        phase = F.interpolate(cycles * 2 * math.pi * self.samples_per_frame, scale_factor=self.samples_per_frame,
                              mode="nearest")
        sines = torch.sin(phase.transpose(1, 2)) * self.sine_amp  # (B, L, H)

        voiced = (per_sample > self.voiced_threshold).to(sines.dtype)
        noise_amp = voiced * self.noise_std + (1 - voiced) * self.sine_amp / 3
        harmonics = sines * voiced + noise_amp * noise.to(sines.dtype)
        return torch.tanh(self.l_linear(harmonics)).transpose(1, 2)
