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

`render_many` renders several streams' chunks at once: calls whose F0 windows have one length (and
finality) share one F0 prediction, and calls whose decoder windows have one length share one source
build and one `decode` over stacked rows (optionally replayed from CUDA graphs:
tts_core/accel/causal_hift_graphs.py). Exact, because every layer is per row: the convolutions, the
left zero pads, the one-sample reflection pad and the STFT/ISTFT all act within a row, and rows of a
group have equal lengths, so no row is padded for another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

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


def decode_windows(hift: CausalHiftGenerator, ends: Iterable[int]) -> list[int]:
    """The decoder window lengths (mel frames, distinct, ascending) of a stream's non-final calls whose mel
    so far ends at `ends` (ascending; e.g. a chunk schedule's): what `CausalHiftGraphs.capture` needs.
    Once the window has slid off the utterance start it is the chunk's new frames +
    `conv_pre_look_right` + 1 + `left_context_frames`."""
    left, look = left_context_frames(hift), hift.f0_predictor.look_ahead
    windows, emitted_frames = set(), 0
    for end in ends:
        windows.add(end - look - max(0, emitted_frames - left))
        emitted_frames = max(0, end - hift.look_ahead_frames - 1)
    return sorted(windows)


def final_window(hift: CausalHiftGenerator, previous_end: int, end: int) -> int:
    """The decoder window (mel frames) of a stream's final call whose mel ends at `end`, after non-final calls
    the last of which ended at `previous_end` (0: none, the final call is the first): all frames not yet
    emitted, from `left_context_frames` before the first of them."""
    emitted_frames = max(0, previous_end - hift.look_ahead_frames - 1)
    return end - max(0, emitted_frames - left_context_frames(hift))


WindowCall = tuple[int, torch.Tensor, int, bool]  # (slot, its mel so far (1, 80, T), samples emitted, finalize)


class WindowDecoder(Protocol):
    """What `render_many` may decode through instead of `hift.decode` (CausalHiftGraphs)."""

    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor: ...


@dataclass(frozen=True)
class _Plan:
    """One call's windows: F0 over mel [f0_from, T) for frames [known, f0_end); the decoder over mel
    [start, f0_end) (the look-ahead frames past f0_end are the F0 predictor's only) with the source of
    frames [start, f0_end)."""

    index: int
    slot: int
    mel: torch.Tensor
    emitted: int
    finalize: bool
    known: int
    f0_from: int
    f0_end: int
    start: int


K = TypeVar("K", bound=Hashable)

# On the CPU one decode over 32 stacked rows took 2x as long as 32 one-row decodes, 8-row ones as long (tiny
# model, one thread: the rows' tensors outgrow the caches); on the GPU a decode costs the same whatever its rows.
CPU_DECODE_ROWS = 8


def _groups(plans: Sequence[_Plan], key: Callable[[_Plan], K]) -> list[list[_Plan]]:
    """Plans by key, in first-seen order (one batched pass each)."""
    out: dict[K, list[_Plan]] = {}
    for plan in plans:
        out.setdefault(key(plan), []).append(plan)
    return list(out.values())


def _rows(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Stacked along dim 0 (a lone call's tensor as it is: no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


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
        self.decode_rows = None if torch.device(device).type == "cuda" else CPU_DECODE_ROWS  # rows a decode at most

    def start(self, slot: int) -> None:
        self.known[slot] = 0

    def render(self, slot: int, mel: torch.Tensor, emitted: int, finalize: bool) -> tuple[torch.Tensor, int]:
        """The samples after `emitted` (1, n) of `hift.inference(mel, finalize)` for the slot's mel so far
        (1, 80, T), and the F0 frames known after it (for `commit`)."""
        return self.render_many([(slot, mel, emitted, finalize)])[0]

    @torch.inference_mode()
    def render_many(self, calls: Sequence[WindowCall], graphs: WindowDecoder | None = None
                    ) -> list[tuple[torch.Tensor, int]]:
        """`render` of each call (distinct slots), in order, in as few batched passes as the windows allow.
        `graphs`: decode through it (a render lane's CUDA graphs) instead of eagerly."""
        slots = [call[0] for call in calls]
        if len(set(slots)) != len(slots):
            raise ValueError(f"render_many: a slot appears twice among {slots}")
        plans = [self._plan(i, *call) for i, call in enumerate(calls)]
        hift = self.hift
        # F0 of the new frames, from windows that reach f0_left frames before them.
        for group in _groups(plans, lambda p: (p.mel.size(2) - p.f0_from, p.finalize, p.mel.dtype)):
            f0 = hift.predict_f0(_rows([p.mel[:, :, p.f0_from:] for p in group]), group[0].finalize)
            for row, p in enumerate(group):
                self.f0[p.slot, p.known:p.f0_end] = f0[row, p.known - p.f0_from:].to(self.f0.dtype)
        # Phase increments of the new frames (frame-local; the utterance's first frame adds the initial phase).
        m = hift.m_source
        for group in _groups(plans, lambda p: (p.f0_end - p.known, p.known == 0, p.mel.dtype)):
            f0 = _rows([self.f0[p.slot:p.slot + 1, p.known:p.f0_end] for p in group]).to(group[0].mel.dtype)
            # the start frame matters only as the utterance's first or not, one answer per group
            fresh = m.increments(f0, group[0].known).to(self.increments.dtype)
            for row, p in enumerate(group):
                self.increments[p.slot, :, p.known:p.f0_end] = fresh[row]
        out: list[tuple[torch.Tensor, int]] = [None] * len(plans)  # type: ignore[list-item]
        spf = hift.cfg.samples_per_frame
        groups = _groups(plans, lambda p: (p.f0_end - p.start, p.finalize, p.mel.dtype))
        step = self.decode_rows or len(plans)
        for group in (g[i:i + step] for g in groups for i in range(0, len(g), step)):
            dtype, finalize = group[0].mel.dtype, group[0].finalize
            f0 = _rows([self.f0[p.slot:p.slot + 1, p.start:p.f0_end] for p in group]).to(dtype)
            # The phase is the running sum of the increments from the start, summed again over all frames so
            # far (H values a frame) exactly as one whole-mel run sums them; per row, as each row's length.
            sums = [torch.cumsum(self.increments[p.slot:p.slot + 1, :, :p.f0_end].to(dtype), dim=2) for p in group]
            cycles = _rows([s[:, :, p.start:] for s, p in zip(sums, group)])
            source = m.from_cycles(f0, cycles, [p.start for p in group])
            window = _rows([p.mel[:, :, p.start:p.f0_end] for p in group])
            wav = (hift if graphs is None else graphs).decode(window, source, finalize)
            for row, p in enumerate(group):
                out[p.index] = (wav[row:row + 1, p.emitted - p.start * spf:], p.f0_end)
        return out

    def _plan(self, index: int, slot: int, mel: torch.Tensor, emitted: int, finalize: bool) -> _Plan:
        look = self.hift.f0_predictor.look_ahead
        frames = mel.size(2)
        known = self.known[slot]
        return _Plan(index=index, slot=slot, mel=mel, emitted=emitted, finalize=finalize, known=known,
                     f0_from=max(0, known - self.f0_left),
                     f0_end=frames if finalize else frames - look,  # frames the source covers in this call
                     # the decoder's window: from `left` frames before the first sample to emit
                     start=max(0, emitted // self.hift.cfg.samples_per_frame - self.left))

    def commit(self, slot: int, known: int) -> None:
        self.known[slot] = known
