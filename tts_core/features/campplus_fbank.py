"""The speaker-embedding input: Kaldi fbank of the 16 kHz prompt minus its time mean, (frames, 80).

As the official `_extract_spk_embedding` feeds campplus.onnx: torchaudio's `compliance.kaldi.fbank`
with 80 bins and dither 0, every other option at Kaldi's default (25 ms Povey window, 10 ms shift,
pre-emphasis 0.97, DC removal, snip edges, power spectrum, log mel, 20 Hz low cut), on samples in
[-1, 1] (not scaled to 16-bit). kaldi-native-fbank computes the same features as Kaldi.
"""

from __future__ import annotations

import kaldi_native_fbank as knf
import numpy as np
import torch

from tts_core.features.audio_input import Waveform, as_mono_tensor

SAMPLE_RATE = 16000
N_MELS = 80


def _fbank_options() -> knf.FbankOptions:
    opts = knf.FbankOptions()
    opts.frame_opts.samp_freq = SAMPLE_RATE
    opts.frame_opts.dither = 0.0  # deterministic, as upstream
    opts.mel_opts.num_bins = N_MELS
    return opts


def kaldi_fbank(wav_16k: Waveform) -> torch.Tensor:
    """Raw log-mel filterbank energies (frames, 80)."""
    wav = as_mono_tensor(wav_16k, "campplus_fbank")
    computer = knf.OnlineFbank(_fbank_options())
    computer.accept_waveform(SAMPLE_RATE, wav.cpu().numpy())
    computer.input_finished()
    frames = [computer.get_frame(i) for i in range(computer.num_frames_ready)]
    return torch.from_numpy(np.asarray(frames, dtype=np.float32).reshape(len(frames), N_MELS))


def campplus_fbank(wav_16k: Waveform) -> torch.Tensor:
    """Mean-normalised fbank (frames, 80), the input campplus.onnx expects (add the batch axis)."""
    feats = kaldi_fbank(wav_16k)
    return feats - feats.mean(dim=0, keepdim=True)
