"""One request's streaming vocoder state: mel chunks in, seamless waveform chunks out.

The official CosyVoice2 token2wav keeps this state in dicts on the shared model object; here each
request owns a `HiftStream` and the shared `HiftGenerator` stays stateless. Per chunk, as upstream:

1. the last `mel_cache_frames` (8) mel frames of the previous chunk are prepended, so the
   convolutions see context across the boundary;
2. a fresh source is drawn for the whole mel, and its first `source_cache_samples` (8 * 480 =
   3840) samples are overwritten with the previous chunk's last source samples, so the excitation
   (its sine phases) continues instead of restarting;
3. the decoded waveform's first 3840 samples are cross-faded with the previous chunk's held-back
   last 3840 samples by a symmetric Hamming window of 2 * 3840 (rising half on the new audio,
   falling half on the old);
4. unless this is the final chunk, the last 3840 samples are held back (re-rendered next time)
   and not returned.

So a non-final chunk of T new frames returns T * 480 samples (the first chunk T * 480 - 3840), and
the final one returns everything left.
"""

from __future__ import annotations

import numpy as np
import torch

from tts_core.hift.generator import HiftGenerator

MEL_CACHE_FRAMES = 8  # CosyVoice2Model.mel_cache_len


def speech_window(source_cache_samples: int) -> torch.Tensor:
    """The cross-fade window upstream builds with np.hamming (symmetric), float64 like upstream."""
    return torch.from_numpy(np.hamming(2 * source_cache_samples))


class HiftStream:
    """Not thread-safe: one request, one caller at a time. Many streams may share one vocoder."""

    def __init__(self, vocoder: HiftGenerator, generator: torch.Generator | None = None,
                 mel_cache_frames: int = MEL_CACHE_FRAMES) -> None:
        self.vocoder = vocoder
        self.generator = generator
        self.mel_cache_frames = mel_cache_frames
        self.source_cache_samples = mel_cache_frames * vocoder.cfg.samples_per_frame
        self.window = speech_window(self.source_cache_samples)
        self._mel: torch.Tensor | None = None  # last mel frames of the previous chunk
        self._source: torch.Tensor | None = None  # last source samples of the previous chunk
        self._speech: torch.Tensor | None = None  # held-back tail of the previous chunk's waveform
        self.finished = False

    @torch.inference_mode()
    def push(self, mel_chunk: torch.Tensor, finalize: bool = False,
             source: torch.Tensor | None = None) -> torch.Tensor:
        """Vocode the new mel frames (B, 80, T) and return the waveform (B, N) that is final now.

        `source`, if given, is used instead of a fresh draw for the cache-extended mel (B, 1,
        (cache + T) * 480) — to replay a recorded excitation; the cache still overwrites its start.
        """
        if self.finished:
            raise RuntimeError("HiftStream already finalized")
        mel = mel_chunk if self._mel is None else torch.cat([self._mel, mel_chunk], dim=2)
        if source is None:
            source = self.vocoder.draw_source(self.vocoder.predict_f0(mel), self.generator)
        else:
            source = source.clone()
        if self._source is not None:
            source[..., :self._source.shape[-1]] = self._source
        wav = self.vocoder.decode(mel, source)
        if self._speech is not None:
            wav = self._cross_fade(wav, self._speech)
        if finalize:
            self.finished = True
            self._mel = self._source = self._speech = None
            return wav
        self._mel = mel[..., -self.mel_cache_frames:]
        self._source = source[..., -self.source_cache_samples:]
        self._speech = wav[..., -self.source_cache_samples:]
        return wav[..., :-self.source_cache_samples]

    def _cross_fade(self, wav: torch.Tensor, previous_tail: torch.Tensor) -> torch.Tensor:
        # Mixed in float64 and rounded once, as upstream multiplies by the numpy float64 window.
        n = self.window.shape[0] // 2
        window = self.window.to(wav.device)
        mixed = wav[..., :n].double() * window[:n] + previous_tail[..., -n:].double() * window[n:]
        out = wav.clone()
        out[..., :n] = mixed.to(wav.dtype)
        return out
