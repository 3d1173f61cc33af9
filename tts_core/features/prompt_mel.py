"""The flow model's prompt features: Matcha-TTS's log-mel of the 24 kHz prompt, (frames, 80).

As Matcha's `mel_spectrogram` (which CosyVoice's `feat_extractor` names): reflect-pad (n_fft - hop)/2
on both sides, uncentred STFT with a periodic Hann window, magnitude sqrt(re^2 + im^2 + 1e-9),
librosa mel filters, natural log clamped at 1e-5. With n_fft 1920 and hop 480 that is exactly one
frame per 480 samples, i.e. two frames per 25 Hz speech token.

The parameters come from the yaml: the official frontend's `_extract_speech_feat` uses the
`feat_extractor` entry (fmax 8000 in the released CosyVoice2 yaml); `mel_spec_transform1` is the
same transform with fmax = Nyquist (the GAN loss's, and the one the golden `prompt_mel` used).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tts_core.features.audio_input import Waveform, as_mono_tensor
from tts_core.features.mel_filters import mel_filterbank


@dataclass(frozen=True)
class PromptMelConfig:
    sample_rate: int
    n_fft: int
    hop: int
    win: int
    n_mels: int
    fmin: float
    fmax: float | None  # None: Nyquist

    @classmethod
    def from_yaml(cls, config: Mapping[str, Any], key: str = "feat_extractor") -> PromptMelConfig:
        """Read a `!name:matcha.utils.audio.mel_spectrogram` entry of `load_model_yaml` output."""
        section = config.get(key)
        if not isinstance(section, Mapping):
            raise ValueError(f"cosyvoice2.yaml: no `{key}:` section")
        if section.get("center", False):
            raise ValueError(f"cosyvoice2.yaml: {key}.center must be False (the flow expects uncentred frames)")
        fmax = section.get("fmax")
        return cls(sample_rate=int(section["sampling_rate"]), n_fft=int(section["n_fft"]),
                   hop=int(section["hop_size"]), win=int(section["win_size"]), n_mels=int(section["num_mels"]),
                   fmin=float(section.get("fmin", 0) or 0), fmax=None if fmax is None else float(fmax))


# Matcha adds this inside the square root so silent bins give a finite log before the clamp.
_MAGNITUDE_EPS = 1e-9
_LOG_FLOOR = 1e-5


def prompt_mel(wav_24k: Waveform, config: PromptMelConfig) -> torch.Tensor:
    """Mono waveform at `config.sample_rate` in [-1, 1] -> log-mel (frames, n_mels) float32."""
    wav = as_mono_tensor(wav_24k, "prompt_mel")
    pad = (config.n_fft - config.hop) // 2
    padded = F.pad(wav[None, None], (pad, pad), mode="reflect")[0]
    window = torch.hann_window(config.win, dtype=wav.dtype, device=wav.device)
    spec = torch.stft(padded, config.n_fft, hop_length=config.hop, win_length=config.win, window=window,
                      center=False, normalized=False, onesided=True, return_complex=True)
    spec = torch.view_as_real(spec)
    magnitude = torch.sqrt(spec.pow(2).sum(-1) + _MAGNITUDE_EPS)
    filters = mel_filterbank(config.sample_rate, config.n_fft, config.n_mels, config.fmin, config.fmax)
    mel = torch.matmul(filters.to(wav.device), magnitude)
    return torch.log(torch.clamp(mel, min=_LOG_FLOOR))[0].transpose(0, 1).contiguous()
