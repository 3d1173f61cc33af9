"""CosyVoice3's vocoder (the official `CausalHiFTGenerator`): mel at 50 Hz -> 24 kHz waveform.

The same NSF + ISTFTNet design as CosyVoice2's `HiftGenerator`, made causal: conv_pre looks
`conv_pre_look_right` frames ahead, the F0 predictor `f0_look_ahead`, everything else only back
(`tts_core.hift.causal_layers`). The excitation is deterministic (`causal_source`). Hence streaming
needs no caches: `inference(mel, finalize=False)` treats the last f0_look_ahead + conv_pre_look_right
frames as look-ahead, drops the last frame's samples (its ISTFT overlap is incomplete) and returns
(frames - look-ahead - 1) x samples_per_frame samples, a prefix of what a longer call returns.

The F0 predictor runs in float64 as the official code does (its output feeds a cumulative phase,
where float32 rounding drifts audibly); `load_causal_hift` keeps it there.
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from pathlib import Path
from typing import Any

import structlog
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.parametrizations import weight_norm

from tts_core.checkpoint import load_strict, normalize_hift_keys, read_state_dict
from tts_core.hift.causal_layers import (
    CausalConv1d,
    CausalDownsampleConv,
    CausalF0Predictor,
    CausalUpsampleConv,
    causal_resblock,
)
from tts_core.hift.causal_source import CausalHarmonicSource, NoiseRecipe
from tts_core.hift.config import HiftConfig, hift_config_from
from tts_core.hift.generator import (
    Mix,
    fold_weight_norm,
    mix_stage,
    residual_blocks,
    source_spectrum,
    spectrum_to_wave,
    upsample_stages,
)
from tts_core.model_family import detect_family

log = structlog.get_logger(__name__)

F0_LOOK_AHEAD = 3  # the official F0 predictor's first kernel is 4 (the frame and 3 after it)
F0_FIRST_KERNEL_KEY = "f0_predictor.condnet.0.parametrizations.weight.original1"


class CausalHiftGenerator(nn.Module):
    def __init__(self, cfg: HiftConfig, conv_pre_look_right: int, noise: NoiseRecipe | None = None,
                 f0_look_ahead: int = F0_LOOK_AHEAD) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv_pre_look_right = conv_pre_look_right
        ch = cfg.base_channels
        spectrum = cfg.n_fft + 2
        noise = noise or NoiseRecipe(cfg.f0_cond_channels, cfg.f0_in_channels, cfg.nb_harmonics + 1)
        self.m_source = CausalHarmonicSource(cfg.sampling_rate, cfg.samples_per_frame, cfg.nb_harmonics,
                                             cfg.nsf_alpha, cfg.nsf_sigma, cfg.nsf_voiced_threshold, noise)
        self.conv_pre = weight_norm(CausalConv1d(cfg.in_channels, ch, conv_pre_look_right + 1, look_ahead=True))
        self.ups = nn.ModuleList(
            weight_norm(CausalUpsampleConv(ch // 2**i, ch // 2 ** (i + 1), k, u))
            for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)))
        strides = [prod(cfg.upsample_rates[i + 1:]) for i in range(len(cfg.upsample_rates))]
        self.source_downs = nn.ModuleList(
            CausalConv1d(spectrum, ch // 2 ** (i + 1), 1) if s == 1
            else CausalDownsampleConv(spectrum, ch // 2 ** (i + 1), s * 2, s)
            for i, s in enumerate(strides))
        self.source_resblocks, self.resblocks = residual_blocks(cfg, causal_resblock)
        self.conv_post = weight_norm(CausalConv1d(ch // 2 ** len(cfg.upsample_rates), spectrum, 7))
        self.f0_predictor = CausalF0Predictor(cfg.f0_in_channels, cfg.f0_cond_channels, f0_look_ahead)
        self.register_buffer("stft_window", torch.hann_window(cfg.n_fft, periodic=True), persistent=False)

    @property
    def look_ahead_frames(self) -> int:
        """Mel frames a non-final call needs beyond those it renders (plus one withheld frame)."""
        return self.f0_predictor.look_ahead + self.conv_pre_look_right

    def predict_f0(self, mel: torch.Tensor, finalize: bool = True) -> torch.Tensor:
        """mel (B, 80, T) -> f0 (B, T) or (B, T - 3) when not final; computed in the predictor's dtype."""
        dtype = self.f0_predictor.classifier.weight.dtype
        return self.f0_predictor(mel.to(dtype), finalize).to(mel.dtype)

    def source(self, f0: torch.Tensor) -> torch.Tensor:
        return self.m_source(f0)

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool = True,
               mix: Mix | None = None) -> torch.Tensor:
        """mel (B, 80, T) + source (B, 1, T x samples_per_frame) -> waveform; when not final the last
        conv_pre_look_right frames are look-ahead and the last frame's samples are withheld."""
        cfg = self.cfg
        mix = mix or mix_stage
        real, imag = source_spectrum(source, cfg, self.stft_window)
        if finalize:
            x = self.conv_pre(mel)
        else:
            k = self.conv_pre_look_right
            x = self.conv_pre(mel[:, :, :-k], mel[:, :, -k:])
            drop = prod(cfg.upsample_rates) * k  # STFT frames of the look-ahead mel frames
            real, imag = real[:, :, :-drop], imag[:, :, :-drop]
        source_spec = torch.cat([real, imag], dim=1)
        x = upsample_stages(self, x, source_spec, cfg, mix)
        wav = spectrum_to_wave(self.conv_post(F.leaky_relu(x)), cfg, self.stft_window)
        if not finalize:
            wav = wav[:, :-cfg.samples_per_frame]
        return torch.clamp(wav, -cfg.audio_limit, cfg.audio_limit)

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, finalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (B, 80, T) -> (waveform (B, samples), source (B, 1, samples of the F0 frames))."""
        f0 = self.predict_f0(mel, finalize)
        source = self.source(f0)
        rendered = mel if finalize else mel[:, :, :-self.f0_predictor.look_ahead]
        return self.decode(rendered, source, finalize), source

    def fold_weight_norm(self) -> CausalHiftGenerator:
        """Replace weight-norm parametrizations by plain weights (see HiftGenerator.fold_weight_norm),
        except the F0 predictor's: the official code computes its weights in float64 from the stored
        g and v, and a float32 fold moved the golden waveform by 0.09 (cumulative phase drift)."""
        for name, child in self.named_children():
            if name != "f0_predictor":
                fold_weight_norm(child)
        return self


def _conv_pre_look_right(config: Mapping[str, Any]) -> int:
    section = config.get("hift")
    if not isinstance(section, Mapping) or "conv_pre_look_right" not in section:
        raise ValueError("cosyvoice3.yaml: hift.conv_pre_look_right is missing")
    return int(section["conv_pre_look_right"])


def _noise_recipe(config: Mapping[str, Any], cfg: HiftConfig) -> NoiseRecipe:
    """The fixed noise depends on the flow's sizes too (the official model builds the flow first)."""
    flow = config.get("flow") if isinstance(config.get("flow"), Mapping) else {}
    default = NoiseRecipe(cfg.f0_cond_channels)
    return NoiseRecipe(
        f0_cond_channels=cfg.f0_cond_channels, f0_in_channels=cfg.f0_in_channels, harmonics=cfg.nb_harmonics + 1,
        mel_bins=int(flow.get("output_size", default.mel_bins)),
        flow_vocab_size=int(flow.get("vocab_size", default.flow_vocab_size)),
        flow_input_size=int(flow.get("input_size", default.flow_input_size)),
        spk_embed_dim=int(flow.get("spk_embed_dim", default.spk_embed_dim)))


def load_causal_hift(model_dir: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                     fold: bool = False) -> CausalHiftGenerator:
    """Build from `<model_dir>/cosyvoice3.yaml` and load `<model_dir>/hift.pt` strictly (parametrization,
    weight_g/weight_v or `generator.`-prefixed keys); the F0 predictor stays float64."""
    model_dir = Path(model_dir)
    found = detect_family(model_dir, expected=3)
    path = model_dir / "hift.pt"
    state = normalize_hift_keys(read_state_dict(path))
    cfg = hift_config_from(found.raw_config, state)
    first = state.get(F0_FIRST_KERNEL_KEY)
    f0_look_ahead = int(first.shape[2]) - 1 if first is not None else F0_LOOK_AHEAD
    model = CausalHiftGenerator(cfg, _conv_pre_look_right(found.raw_config), _noise_recipe(found.raw_config, cfg),
                                f0_look_ahead)
    load_strict(model, state, str(path))
    if fold:
        model.fold_weight_norm()
    model.to(device=device, dtype=dtype).eval()
    model.f0_predictor.to(torch.float64)
    log.info("hift_loaded", path=str(path), device=str(device), dtype=str(dtype), causal=True,
             base_channels=model.cfg.base_channels, folded=fold)
    return model
