"""CosyVoice3's causal HiFT run chunk by chunk over a bounded left context, instead of over all mel so far.

The official token2wav re-runs the causal HiFT over the whole mel every chunk and emits the samples
past those already sent (its cost grows with the utterance). Every layer of the causal HiFT sees a
bounded past (left-padded convolutions, the F0 predictor's causal convolutions, the STFT/ISTFT
windows), except the excitation's phase: a running sum of per-frame increments from the utterance
start. So a chunk is computed exactly from
- the F0 of the new frames, predicted from a window reaching `f0_left` frames before them;
- the source of the window's frames from the stored F0 of earlier frames and the running sum of the
  stored per-frame phase increments (per stream: one F0 value and `harmonics` increments a frame,
  ~40 bytes; the sum over all frames so far is the only work that grows with the utterance: H
  values a frame);
- the decoder over a window starting `left` frames before the first sample to emit: its zero padding
  at the window start reaches fewer than `left` frames into it (`left_context_frames`, a bound summed
  over every layer's left reach), so the emitted samples are the whole-mel run's.
Per chunk the vocoder then costs chunk + ~`left` frames whatever the utterance's length.

State lives in slot rows (the renderer's stream slots): F0 and phase increments per frame, and how many
frames' F0 is known. Nothing is kept until `commit` (a failed render leaves the stream as it was).
"""

from __future__ import annotations

import math

import torch

from tts_core.hift.causal import CausalHiftGenerator
from tts_core.hift.causal_layers import CausalConv1d


def f0_left_frames(hift: CausalHiftGenerator) -> int:
    """Frames of past mel the F0 predictor's causal convolutions reach."""
    return sum(m.pad for m in hift.f0_predictor.modules() if isinstance(m, CausalConv1d) and not m.look_ahead)


def left_context_frames(hift: CausalHiftGenerator) -> int:
    """An upper bound (in mel frames, + 1) on how far back the decoder's output depends on its input: the
    left reach of every convolution on every path, each at its stage's rate, summed, plus the STFT and
    ISTFT windows and the reflection pad."""
    cfg = hift.cfg
    stft_rate = cfg.samples_per_frame // cfg.hop_len  # STFT frames per mel frame
    reach, rate = 0.0, 1

    def block(kernel: int, dilations: tuple[int, ...]) -> int:
        return sum(d * (kernel - 1) + (kernel - 1) for d in dilations)

    for i, (u, k) in enumerate(zip(cfg.upsample_rates, cfg.upsample_kernel_sizes)):
        rate *= u
        stage = (k - 1) + max(block(kk, ds) for kk, ds in zip(cfg.resblock_kernel_sizes, cfg.resblock_dilation_sizes))
        stage += block(cfg.source_resblock_kernel_sizes[i], cfg.source_resblock_dilation_sizes[i])
        reach += stage / rate
        s = math.prod(cfg.upsample_rates[i + 1:])
        reach += (2 * s - 1) / stft_rate  # the source's downsampling convolution (kernel 2 s at the STFT rate)
    reach += (6 + 1 + 2 * cfg.n_fft // cfg.hop_len) / stft_rate  # conv_post (7), reflection, STFT + ISTFT
    return math.ceil(reach) + 1


class HiftWindows:
    """Per stream slot: F0 (Hz) and phase increments per frame, for the bounded-window vocoder."""

    def __init__(self, hift: CausalHiftGenerator, slots: int, max_frames: int, device: torch.device) -> None:
        self.hift = hift
        self.left, self.f0_left = left_context_frames(hift), f0_left_frames(hift)
        harmonics = hift.m_source.l_linear.in_features
        # float32 (float64 where the vocoder runs in it): holds the vocoder's values without rounding
        dtype = torch.float64 if hift.stft_window.dtype == torch.float64 else torch.float32
        self.f0 = torch.zeros(slots, max_frames, device=device, dtype=dtype)
        self.increments = torch.zeros(slots, harmonics, max_frames, device=device, dtype=dtype)
        self.known = [0] * slots  # frames whose F0 (and phase sum) is kept

    def start(self, slot: int) -> None:
        self.known[slot] = 0

    @torch.inference_mode()
    def render(self, slot: int, mel: torch.Tensor, emitted: int, finalize: bool) -> tuple[torch.Tensor, int]:
        """The samples after `emitted` (1, n) of `hift.inference(mel, finalize)` for the slot's mel so far
        (1, 80, T), and the F0 frames known after it (for `commit`)."""
        hift, cfg = self.hift, self.hift.cfg
        look = hift.f0_predictor.look_ahead
        frames = mel.size(2)
        f0_end = frames if finalize else frames - look  # frames the source covers in this call
        known = self.known[slot]
        # F0 of the new frames, from a window that reaches f0_left frames before them.
        a_f0 = max(0, known - self.f0_left)
        f0_new = hift.predict_f0(mel[:, :, a_f0:], finalize)[:, known - a_f0:]
        self.f0[slot, known:f0_end] = f0_new[0].to(self.f0.dtype)
        # Phase increments of the new frames (frame-local); the phase is their running sum from the start,
        # summed again over all frames so far (H values a frame) exactly as one whole-mel run sums them.
        m = hift.m_source
        fresh = m.increments(self.f0[slot:slot + 1, known:f0_end].to(mel.dtype), known)
        self.increments[slot, :, known:f0_end] = fresh[0].to(self.increments.dtype)
        # The decoder's window: from `left` frames before the first sample to emit.
        start = max(0, emitted // cfg.samples_per_frame - self.left)
        f0 = self.f0[slot:slot + 1, start:f0_end].to(mel.dtype)
        cycles = torch.cumsum(self.increments[slot:slot + 1, :, :f0_end].to(mel.dtype), dim=2)[:, :, start:]
        source = m.from_cycles(f0, cycles, start)
        window = mel[:, :, start:] if finalize else mel[:, :, start:frames - look]
        wav = hift.decode(window, source, finalize)
        return wav[:, emitted - start * cfg.samples_per_frame:], f0_end

    def commit(self, slot: int, known: int) -> None:
        self.known[slot] = known
