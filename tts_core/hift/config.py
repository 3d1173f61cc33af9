"""HiFT vocoder hyper-parameters, read from the `hift:` section of the official yaml.

Channel widths come from the weights where the yaml and the checkpoint could disagree (a re-sized
checkpoint keeps its own `conv_pre` width); every algorithmic setting (rates, kernels, dilations,
NSF constants, ISTFT sizes) comes from the yaml. Nothing here builds modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from math import prod
from typing import Any

import torch


@dataclass(frozen=True)
class HiftConfig:
    in_channels: int
    base_channels: int
    nb_harmonics: int
    sampling_rate: int
    nsf_alpha: float
    nsf_sigma: float
    nsf_voiced_threshold: float
    upsample_rates: tuple[int, ...]
    upsample_kernel_sizes: tuple[int, ...]
    n_fft: int
    hop_len: int
    resblock_kernel_sizes: tuple[int, ...]
    resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    source_resblock_kernel_sizes: tuple[int, ...]
    source_resblock_dilation_sizes: tuple[tuple[int, ...], ...]
    lrelu_slope: float
    audio_limit: float
    f0_in_channels: int
    f0_cond_channels: int

    @property
    def samples_per_frame(self) -> int:
        """Waveform samples per mel frame (480 at 24 kHz)."""
        return prod(self.upsample_rates) * self.hop_len


def hift_config_from(config: Mapping[str, Any], state: Mapping[str, torch.Tensor] | None = None) -> HiftConfig:
    """Build from `load_model_yaml(...)` output; `state` (normalized keys) supplies the widths."""
    section = config.get("hift")
    if not isinstance(section, Mapping):
        raise ValueError("cosyvoice2.yaml: no `hift:` section")
    f0 = section.get("f0_predictor")
    if not isinstance(f0, Mapping):
        raise ValueError("cosyvoice2.yaml: hift.f0_predictor is missing")

    def need(mapping: Mapping[str, Any], key: str, where: str = "hift") -> Any:
        if key not in mapping:
            raise ValueError(f"cosyvoice2.yaml: {where}.{key} is missing")
        return mapping[key]

    istft = need(section, "istft_params")
    in_channels = int(need(section, "in_channels"))
    base_channels = int(need(section, "base_channels"))
    f0_cond = int(need(f0, "cond_channels", "hift.f0_predictor"))
    if state is not None:
        pre = state.get("conv_pre.parametrizations.weight.original1")
        if pre is not None:
            base_channels, in_channels = int(pre.shape[0]), int(pre.shape[1])
        cond = state.get("f0_predictor.condnet.0.parametrizations.weight.original1")
        if cond is not None:
            f0_cond = int(cond.shape[0])
    return HiftConfig(
        in_channels=in_channels,
        base_channels=base_channels,
        nb_harmonics=int(need(section, "nb_harmonics")),
        sampling_rate=int(need(section, "sampling_rate")),
        nsf_alpha=float(need(section, "nsf_alpha")),
        nsf_sigma=float(need(section, "nsf_sigma")),
        nsf_voiced_threshold=float(need(section, "nsf_voiced_threshold")),
        upsample_rates=tuple(int(r) for r in need(section, "upsample_rates")),
        upsample_kernel_sizes=tuple(int(k) for k in need(section, "upsample_kernel_sizes")),
        n_fft=int(need(istft, "n_fft", "hift.istft_params")),
        hop_len=int(need(istft, "hop_len", "hift.istft_params")),
        resblock_kernel_sizes=tuple(int(k) for k in need(section, "resblock_kernel_sizes")),
        resblock_dilation_sizes=tuple(tuple(int(d) for d in ds) for ds in need(section, "resblock_dilation_sizes")),
        source_resblock_kernel_sizes=tuple(int(k) for k in need(section, "source_resblock_kernel_sizes")),
        source_resblock_dilation_sizes=tuple(
            tuple(int(d) for d in ds) for ds in need(section, "source_resblock_dilation_sizes")),
        lrelu_slope=float(need(section, "lrelu_slope")),
        audio_limit=float(need(section, "audio_limit")),
        f0_in_channels=int(f0.get("in_channels", in_channels)),
        f0_cond_channels=f0_cond,
    )
