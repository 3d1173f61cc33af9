"""Conditional flow matching sampler: Euler integration of the estimator's velocity field.

Starts from a fixed noise buffer (the official draws it once, `torch.randn` right after seeding
every RNG with 0, and slices its first T frames for every call: the same tokens give the same mel,
and a streaming call's frames match the non-streaming ones where their inputs match). Time follows
the cosine schedule t_k = 1 - cos(pi/2 * k/N) and each step evaluates the estimator on a batch of
two rows, conditioned and unconditioned (mu, speaker and prompt mel zeroed), mixed by
classifier-free guidance (Le et al., Voicebox, 2023): v = (1 + w) v_cond - w v_uncond.

`guided_velocity` is the hot loop body (N steps x batch 2); it takes only tensors, so a runtime
can capture it in a CUDA graph per frame count. `solve` also takes B requests at once (rows 0..B-1
conditioned, B..2B-1 unconditioned), each with its own key mask: CosyVoice3's renderer batches
streams of different lengths that way (right-padded; the DiT's causal position convolution and
masked attention keep a row's frames independent of the padding).
"""

from __future__ import annotations

import torch
from torch import nn

from tts_core.flow.estimator import FlowEstimator
from tts_core.flow.frame_cache import FrameCache

NOISE_SEED = 0
NOISE_FRAMES = 50 * 300  # the official buffer: 300 s of mel at 50 frames/s


def official_noise(mel_bins: int) -> torch.Tensor:
    """(1, mel_bins, 15000) float32 CPU: what `torch.manual_seed(0); torch.randn(...)` gives."""
    gen = torch.Generator(device="cpu").manual_seed(NOISE_SEED)
    # device: a CPU draw also where modules are made under a device context (pipeline.load)
    return torch.randn([1, mel_bins, NOISE_FRAMES], generator=gen, device="cpu")


def time_span(n_timesteps: int, scheduler: str, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    span = torch.linspace(0, 1, n_timesteps + 1, device=device, dtype=dtype)
    if scheduler == "cosine":
        span = 1 - torch.cos(span * 0.5 * torch.pi)
    return span


def euler_times(n_timesteps: int, scheduler: str, device: torch.device,
                dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(t (1,), dt 0-d) of each Euler step in the official solver's accumulation order (t += dt;
    dt = t_{k+1} - t), so the rounding in 16-bit dtypes matches it step for step."""
    span = time_span(n_timesteps, scheduler, device, dtype)
    t, dt = span[0].unsqueeze(0), span[1] - span[0]
    steps = []
    for step in range(1, len(span)):
        steps.append((t, dt))
        t = t + dt
        if step < len(span) - 1:
            dt = span[step + 1] - t
    return steps


def guided_velocity(estimator: FlowEstimator, x_in: torch.Tensor, mask_in: torch.Tensor, mu_in: torch.Tensor,
                    t_in: torch.Tensor, spks_in: torch.Tensor, cond_in: torch.Tensor,
                    attn_mask: torch.Tensor | None, cfg_rate: float, cache: FrameCache | None = None) -> torch.Tensor:
    """One estimator call on the conditioned rows then as many unconditioned ones -> guided velocity (B, 80, T)."""
    v = estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, attn_mask, cache)
    v_cond, v_uncond = v.chunk(2)
    return (1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond


class FlowSampler(nn.Module):
    """Holds the estimator (checkpoint prefix `decoder.estimator.`) and the fixed noise buffer."""

    def __init__(self, estimator: FlowEstimator, mel_bins: int, n_timesteps: int, scheduler: str,
                 cfg_rate: float) -> None:
        super().__init__()
        self.estimator = estimator
        self.n_timesteps = n_timesteps
        self.scheduler = scheduler
        self.cfg_rate = cfg_rate
        self.register_buffer("rand_noise", official_noise(mel_bins), persistent=False)

    def noise(self, frames: int, dtype: torch.dtype) -> torch.Tensor:
        if frames > self.rand_noise.size(2):
            raise ValueError(f"flow: {frames} mel frames exceed the {self.rand_noise.size(2)}-frame noise buffer")
        return self.rand_noise[:, :, :frames].to(dtype)

    def forward(self, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
                streaming: bool) -> torch.Tensor:
        """mu, cond (1, 80, T); mask (1, 1, T); spks (1, 80) -> mel (1, 80, T) float32."""
        frames = mu.size(2)
        attn_mask = self.estimator.attention_mask(frames, streaming, mu.device)
        return self.solve(self.noise(frames, mu.dtype), mu, mask, spks, cond, attn_mask)

    def solve(self, x: torch.Tensor, mu: torch.Tensor, mask: torch.Tensor, spks: torch.Tensor, cond: torch.Tensor,
              attn_mask: torch.Tensor | None, step_caches: list[FrameCache] | None = None) -> torch.Tensor:
        """Integrate from noise `x` (B, 80, T) (mu, cond (B, 80, T), mask (B, 1, T), spks (B, 80)). With
        `step_caches` (one per Euler step, batch 1) the T frames continue frames that earlier passes
        computed, and the caches advance with them."""
        if step_caches is not None and len(step_caches) != self.n_timesteps:
            raise ValueError(f"flow sampler: need {self.n_timesteps} step caches, got {len(step_caches)}")
        frames, rows = mu.size(2), mu.size(0)

        # Per-call buffers: rows [0, B) conditioned, [B, 2B) unconditioned (mu/spks/cond stay zero).
        dtype = spks.dtype
        x_in = torch.zeros([2 * rows, x.size(1), frames], device=mu.device, dtype=dtype)
        mask_in = mask.to(dtype).expand(rows, -1, -1).repeat(2, 1, 1)
        mu_in = torch.zeros_like(x_in)
        mu_in[:rows] = mu
        t_in = torch.zeros([2 * rows], device=mu.device, dtype=dtype)
        spks_in = torch.zeros([2 * rows, spks.size(1)], device=mu.device, dtype=dtype)
        spks_in[:rows] = spks
        cond_in = torch.zeros_like(x_in)
        cond_in[:rows] = cond

        for step, (t, dt) in enumerate(euler_times(self.n_timesteps, self.scheduler, mu.device, mu.dtype)):
            x_in[:rows] = x
            x_in[rows:] = x
            t_in[:] = t
            cache = step_caches[step] if step_caches is not None else None
            v = guided_velocity(self.estimator, x_in, mask_in, mu_in, t_in, spks_in, cond_in, attn_mask,
                                self.cfg_rate, cache)
            x = x + dt * v
        return x.float()
