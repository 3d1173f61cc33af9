"""HiFT (neural source filter + ISTFTNet): 80-bin mel at 50 Hz -> 24 kHz waveform.

`HiftGenerator` keeps the official HiFTGenerator's state-dict names. The work splits in two so the
streaming runtime can own the randomness:

    f0 = predict_f0(mel)                     deterministic
    source = draw_source(f0, generator)      the only random step
    wav = decode(mel, source)                deterministic given the source

`inference(mel, cache_source, generator)` chains them as the official `inference` does, with the
cached source of the previous chunk written over the start of the new one. The module holds no
per-request state; `streaming.HiftStream` does.
"""

from __future__ import annotations

from collections.abc import Callable
from math import prod
from pathlib import Path

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from tts_core.checkpoint import load_strict, normalize_hift_keys, read_state_dict
from tts_core.hift.config import HiftConfig, hift_config_from
from tts_core.hift.f0_predictor import F0Predictor
from tts_core.hift.layers import ResBlock, wn_conv1d
from tts_core.hift.source import HarmonicSource
from tts_core.model_family import detect_family

log = structlog.get_logger(__name__)

# Upstream clips the predicted STFT magnitude (exp of a conv output) before the inverse transform.
_MAX_MAGNITUDE = 1e2


Mix = Callable[[tuple[nn.Module, ...], nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def mix_stage(blocks: tuple[nn.Module, ...], source_block: nn.Module, x: torch.Tensor,
              source: torch.Tensor) -> torch.Tensor:
    """One upsampling stage after its transposed convolution: add the source branch, then average
    the stage's residual blocks (one per kernel size). Most of HiFT's elementwise work (Snake) is
    here, on the longest tensors of the model, which is why accel compiles this one function."""
    x = x + source_block(source)
    acc = blocks[0](x)
    for block in blocks[1:]:
        acc = acc + block(x)
    return acc / len(blocks)


def residual_blocks(cfg: HiftConfig, make: Callable[[int, int, tuple[int, ...]], nn.Module]
                    ) -> tuple[nn.ModuleList, nn.ModuleList]:
    """(source_resblocks, resblocks): one source block per stage, then one block per stage and kernel
    size, each `make(channels, kernel, dilations)` at that stage's width."""
    ch = cfg.base_channels
    source = nn.ModuleList(
        make(ch // 2 ** (i + 1), k, d)
        for i, (k, d) in enumerate(zip(cfg.source_resblock_kernel_sizes, cfg.source_resblock_dilation_sizes)))
    stages = nn.ModuleList(
        make(ch // 2 ** (i + 1), k, d)
        for i in range(len(cfg.upsample_rates))
        for k, d in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
    return source, stages


def fold_weight_norm(model: nn.Module) -> None:
    """Replace every weight-norm parametrization by its plain weight (same function, fewer ops)."""
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)


def source_spectrum(source: torch.Tensor, cfg: HiftConfig, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(real, imag) STFT of the excitation (B, 1, L), each (B, n_fft/2 + 1, frames)."""
    spec = torch.view_as_real(torch.stft(source.squeeze(1), cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window,
                                         return_complex=True))
    return spec[..., 0], spec[..., 1]


def upsample_stages(model: nn.Module, x: torch.Tensor, source_spec: torch.Tensor, cfg: HiftConfig, mix: Mix
                    ) -> torch.Tensor:
    """The upsampling stages both HiFT generators run (CosyVoice2's and CosyVoice3's causal one: `model` has
    `ups`, `resblocks`, `source_resblocks`, `source_downs`): each stage upsamples, then mixes the residual
    blocks with the source's spectrum at that rate."""
    n_kernels = len(cfg.resblock_kernel_sizes)
    last = len(model.ups) - 1
    for i, up in enumerate(model.ups):
        x = up(F.leaky_relu(x, cfg.lrelu_slope))
        if i == last:
            # One sample of left reflection makes the frame count equal the STFT's (centred) count.
            x = F.pad(x, (1, 0), mode="reflect")
        x = mix(tuple(model.resblocks[i * n_kernels:(i + 1) * n_kernels]), model.source_resblocks[i],
                x, model.source_downs[i](source_spec))
    return x


def spectrum_to_wave(x: torch.Tensor, cfg: HiftConfig, window: torch.Tensor) -> torch.Tensor:
    """conv_post output (B, n_fft + 2, frames) -> waveform (B, L) by the inverse STFT (not yet clamped)."""
    bins = cfg.n_fft // 2 + 1
    magnitude = torch.clamp(torch.exp(x[:, :bins]), max=_MAX_MAGNITUDE)
    phase = torch.sin(x[:, bins:])  # upstream's (redundant) sin is part of the trained function
    spectrum = torch.complex(magnitude * torch.cos(phase), magnitude * torch.sin(phase))
    return torch.istft(spectrum, cfg.n_fft, cfg.hop_len, cfg.n_fft, window=window)


class HiftGenerator(nn.Module):
    def __init__(self, cfg: HiftConfig) -> None:
        super().__init__()
        self.cfg = cfg
        ch = cfg.base_channels
        spectrum = cfg.n_fft + 2  # real and imaginary halves of n_fft/2 + 1 bins
        self.m_source = HarmonicSource(cfg.sampling_rate, cfg.nb_harmonics, cfg.nsf_alpha, cfg.nsf_sigma,
                                       cfg.nsf_voiced_threshold)
        self.conv_pre = wn_conv1d(cfg.in_channels, ch, 7, padding=3)
        self.ups = nn.ModuleList(
            torch.nn.utils.parametrizations.weight_norm(
                nn.ConvTranspose1d(ch // 2**i, ch // 2 ** (i + 1), k, u, padding=(k - u) // 2))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))

        # The source spectrogram (one frame per hop_len samples) is strided down to each upsampling
        # stage's frame rate: the last stage sees it as is, earlier ones by the product of later rates.
        strides = [prod(cfg.upsample_rates[i + 1:]) for i in range(len(cfg.upsample_rates))]
        self.source_downs = nn.ModuleList(
            nn.Conv1d(spectrum, ch // 2 ** (i + 1), 1) if s == 1
            else nn.Conv1d(spectrum, ch // 2 ** (i + 1), s * 2, s, padding=s // 2)
            for i, s in enumerate(strides))
        self.source_resblocks, self.resblocks = residual_blocks(cfg, ResBlock)
        self.conv_post = wn_conv1d(ch // 2 ** len(cfg.upsample_rates), spectrum, 7, padding=3)
        self.f0_predictor = F0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels)
        # Periodic Hann, as scipy's get_window("hann", n, fftbins=True) upstream.
        self.register_buffer("stft_window", torch.hann_window(cfg.n_fft, periodic=True), persistent=False)

    # -- the three steps -------------------------------------------------------------------------

    def predict_f0(self, mel: torch.Tensor) -> torch.Tensor:
        """mel (B, 80, T) -> F0 in Hz per frame (B, T)."""
        return self.f0_predictor(mel)

    def draw_source(self, f0: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """F0 per frame (B, T) -> excitation (B, 1, T * samples_per_frame)."""
        per_sample = f0[:, None, :].repeat_interleave(self.cfg.samples_per_frame, dim=-1)
        return self.m_source(per_sample, generator)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, mix: Mix | None = None) -> torch.Tensor:
        """mel (B, 80, T) and source (B, 1, T * samples_per_frame) -> waveform (B, T * samples_per_frame).
        `mix` runs each stage's residual blocks (`mix_stage` unless given: accel compiles it)."""
        cfg = self.cfg
        mix = mix or mix_stage
        source_spec = torch.cat(source_spectrum(source, cfg, self.stft_window), dim=1)

        x = self.conv_pre(mel)
        x = upsample_stages(self, x, source_spec, cfg, mix)

        # Upstream uses leaky_relu's default slope (0.01) here, not lrelu_slope.
        x = self.conv_post(F.leaky_relu(x))
        wav = spectrum_to_wave(x, cfg, self.stft_window)
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None,
                  generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B, 80, T) -> (waveform (B, L), source (B, 1, L)); `cache_source` (B, 1, C) replaces
        the first C source samples so a chunk continues the previous chunk's excitation."""
        source = self.draw_source(self.predict_f0(mel), generator)
        if cache_source is not None and cache_source.shape[-1] > 0:
            source[..., :cache_source.shape[-1]] = cache_source
        return self.decode(mel, source), source

    # -- speed -----------------------------------------------------------------------------------

    def fold_weight_norm(self) -> HiftGenerator:
        """Replace every weight-norm parametrization by its plain weight (same function, fewer ops).
        Call after loading: the folded module no longer accepts checkpoint keys. Fold a freshly
        loaded module, not a deepcopy of one: PyTorch shares the parametrized class between copies,
        so removing it from one copy breaks the other."""
        fold_weight_norm(self)
        return self


def load_hift(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
              fold: bool = False) -> HiftGenerator:
    """Build from `<model_dir>/cosyvoice2.yaml` and load `<model_dir>/hift.pt` strictly (any of the
    three key layouts); `fold=True` folds weight norm for inference."""
    model_dir = Path(model_dir)
    found = detect_family(model_dir, expected=2)
    return load_hift_checkpoint(found.raw_config, model_dir / "hift.pt", device, dtype, fold)


def load_hift_checkpoint(config: dict, path: str | Path, device: torch.device | str = "cpu",
                         dtype: torch.dtype = torch.float32, fold: bool = False) -> HiftGenerator:
    """Build from parsed yaml data and load the state dict at `path` strictly."""
    state = normalize_hift_keys(read_state_dict(path))
    cfg = hift_config_from(config, state)
    model = HiftGenerator(cfg)
    load_strict(model, state, str(path))
    if fold:
        model.fold_weight_norm()
    model.to(device=device, dtype=dtype).eval()
    log.info("hift_loaded", path=str(path), device=str(device), dtype=str(dtype),
             base_channels=cfg.base_channels, folded=fold)
    return model
