"""The speech tokenizer's input: Whisper's log-mel of the 16 kHz prompt, (1, n_mels, frames).

As `whisper.log_mel_spectrogram(audio, n_mels=128)` that CosyVoice's `_extract_speech_token` calls:
centred STFT (reflect pad) with n_fft 400, hop 160 and a periodic Hann window, the last frame
dropped (so frames = samples // 160), power spectrum, librosa mel filters, log10 clamped at 1e-10,
floored at (max - 8), then (x + 4) / 4.
"""

from __future__ import annotations

import torch

from tts_core.features.audio_input import Waveform, as_mono_tensor
from tts_core.features.mel_filters import mel_filterbank

SAMPLE_RATE = 16000
N_FFT = 400
HOP = 160
_POWER_FLOOR = 1e-10
_DYNAMIC_RANGE_LOG10 = 8.0  # 80 dB below the loudest bin


def whisper_logmel(wav_16k: Waveform, n_mels: int = 128) -> torch.Tensor:
    wav = as_mono_tensor(wav_16k, "whisper_logmel")
    window = torch.hann_window(N_FFT, dtype=wav.dtype, device=wav.device)
    stft = torch.stft(wav[None], N_FFT, HOP, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    mel = mel_filterbank(SAMPLE_RATE, N_FFT, n_mels).to(wav.device) @ power
    log_spec = torch.clamp(mel, min=_POWER_FLOOR).log10()
    log_spec = torch.maximum(log_spec, log_spec.max() - _DYNAMIC_RANGE_LOG10)
    return (log_spec + 4.0) / 4.0
