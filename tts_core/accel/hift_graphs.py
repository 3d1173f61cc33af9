"""CUDA-graph replay of one HiFT vocoder chunk (F0, source draw, decode) for a fixed frame count.

Equivalent to `HiftGenerator.inference(mel, cache_source)` with the source noise drawn from a
generator of the graph's own (graphs replay philox draws with a fresh offset every time, so each
replay draws new noise, as an eager call would). Streaming glue (mel cache, cross-fade) stays in
`HiftStream`-style code around it; a graph per (frames, cached source samples) covers the official
schedule: the first chunk has no cache, later chunks carry 8 frames / 3840 samples.

`compiled_mix` fuses each upsampling stage's residual blocks (torch.compile) for the graphs to record.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from tts_core.accel.graph_capture import WARMUP_RUNS, capture_graph, compiling_at_start_up
from tts_core.hift.generator import HiftGenerator, Mix, mix_stage


def overlap_add_istft(spec: torch.Tensor, n_fft: int, hop_length: int, win_length: int | None = None,
                      window: torch.Tensor | None = None, center: bool = True, **unused: object) -> torch.Tensor:
    """torch.istft (onesided, center=True, no length) without its host-side NOLA check, which syncs
    and so cannot be captured: inverse rFFT per frame, windowed overlap-add, envelope division.
    The vocoder's periodic Hann window at hop n_fft/4 satisfies NOLA, so the check is moot."""
    if unused.get("length") is not None or not center or unused.get("normalized") or unused.get("onesided") is False:
        raise ValueError("overlap_add_istft covers only onesided, centred, unnormalised, length-free use")
    win = window if window is not None else torch.ones(n_fft, device=spec.device)
    frames = torch.fft.irfft(spec, n=n_fft, dim=-2) * win[:, None]  # (B, n_fft, F)
    count = frames.shape[-1]
    total = n_fft + hop_length * (count - 1)
    fold = dict(output_size=(1, total), kernel_size=(1, n_fft), stride=(1, hop_length))
    wav = F.fold(frames, **fold)[:, 0, 0]
    envelope = F.fold(win.pow(2)[None, :, None].expand(1, n_fft, count), **fold)[:, 0, 0]
    half = n_fft // 2
    return (wav / envelope)[:, half:total - half]


@contextmanager
def capturable_istft() -> Iterator[None]:
    """Swap torch.istft for `overlap_add_istft` while a graph is captured (at start-up, before any
    request runs: the swap is process-wide for its duration)."""
    original = torch.istft
    torch.istft = overlap_add_istft
    try:
        yield
    finally:
        torch.istft = original


def compiled_mix() -> Mix:
    """`mix_stage` compiled (inductor): eagerly each Snake is seven elementwise kernels over the
    stage's whole tensor (B x 64-256 channels x up to 13k samples: ~100 MB at 32 rows), and the
    residual adds and the average more; compiled, a Snake and the add before it are one kernel, and
    only the convolutions (cuDNN) remain apart. Sizes are symbolic: each stage compiles once for
    one row and once for more (six compiles), in `GraphedHift`'s capture at start-up, and runs only
    inside graphs (eager fallbacks use the plain stage)."""
    return torch.compile(mix_stage, fullgraph=True, dynamic=True)


class GraphedHift:
    """Up to `rows` chunks of `frames` mel frames (cache included) in one replay; rows beyond the
    call's are left over from earlier calls and their outputs ignored (every row is independent).
    Graphs that share a memory `pool` must not run at once, and each caller copies what it keeps
    of the outputs before the next replay of any of them."""

    def __init__(self, vocoder: HiftGenerator, frames: int, cache_samples: int = 0, warmup: int = WARMUP_RUNS, rows: int = 1,
                 pool=None, stream: torch.cuda.Stream | None = None, mix: Mix | None = None) -> None:
        param = next(vocoder.parameters())
        if not param.is_cuda:
            raise RuntimeError("GraphedHift needs the vocoder on a CUDA device")
        self.vocoder = vocoder
        self.rows, self.frames = rows, frames
        self.cache_samples = cache_samples
        device = param.device
        self.mel = torch.zeros(rows, vocoder.cfg.in_channels, frames, dtype=param.dtype, device=device)
        self.cache_source = torch.zeros(rows, 1, max(cache_samples, 1), dtype=param.dtype, device=device)
        self.mix = mix
        # Its own, not the default generator: render lanes replay their graphs at once, each graph
        # from one lane's thread, and concurrent replays drawing from one generator race on its
        # offset (graph_capture).
        self.generator = torch.Generator(device=device)
        self.generator.seed()
        self._graph = torch.cuda.CUDAGraph()
        with capturable_istft(), compiling_at_start_up(mix is not None):
            self._out = capture_graph(self._graph, self._call, warmup, pool=pool, stream=stream,
                                      generator=self.generator)

    def _call(self) -> tuple[torch.Tensor, torch.Tensor]:
        v = self.vocoder
        source = v.draw_source(v.predict_f0(self.mel), self.generator)
        if self.cache_samples:
            source[..., :self.cache_samples] = self.cache_source
        return v.decode(self.mel, source, self.mix), source

    @torch.inference_mode()
    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """mel (r <= rows, 80, frames) -> (waveform (r, L), source (r, 1, L)), views valid until
        the next replay of this graph (or of any graph sharing its pool)."""
        r = mel.size(0)
        if r > self.rows or mel.size(-1) != self.frames:
            raise ValueError(f"GraphedHift: captured for <= {self.rows} rows of {self.frames} frames, "
                             f"got {r} of {mel.size(-1)}")
        self.mel[:r].copy_(mel)
        if self.cache_samples:
            if cache_source is None or cache_source.shape[-1] != self.cache_samples:
                raise ValueError(f"GraphedHift: captured for {self.cache_samples} cached source samples")
            self.cache_source[:r].copy_(cache_source)
        self._graph.replay()
        wav, source = self._out
        return wav[:r], source[:r]
