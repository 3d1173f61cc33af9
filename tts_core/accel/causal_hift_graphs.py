"""CUDA-graph replay of CosyVoice3's causal HiFT decoder over a batch of stream windows (the decode that
`HiftWindows.render_many` runs per group of equal windows): one graph per (rows, window frames) bucket.

Eagerly one window's decode is hundreds of small kernels (~19 ms on the H100 whatever the rows); a replay
launches them as one. Only the decode is captured: the F0 prediction and the source build read
per-stream state at data-dependent offsets and stay eager (tts_core/hift/causal_window.py). The
captured `decode` runs with `capturable_istft` (torch.istft's NOLA check syncs with the host and so
cannot be recorded); the rest of it is shape-static tensor work (its slicing depends on shapes only,
fixed per bucket) and draws no random numbers.

Captured for the windows a chunk schedule produces: non-final ones (`decode_windows`), with the rows of the
lane's batches, and final ones (`final_window`: an utterance's tail, one length per tail length), one row
each. Eagerly a final window costs ~20 ms a stream (hundreds of kernels), each its own group: with 100 calls
arriving at 10/s whose random-weight utterances ended after 2-3 chunks, the later lane's calls were mostly
final chunks and 77 of the calls heard silence mid-speech, in groups whose silences ended together every
1-1.8 s (docs/PERF_NOTES.md, session 6). A call replays
the smallest bucket with enough rows (spare rows keep an earlier call's inputs, their outputs ignored: every
row is independent); more rows than the largest bucket replay it several times. Uncaptured lengths and other
dtypes run eagerly, counted in `eager_calls`.

One memory pool and one capture stream per instance: each render lane captures and replays its own,
possibly while another lane replays its graphs.
"""

from __future__ import annotations

from collections.abc import Iterable

import structlog
import torch

from tts_core.accel.graph_capture import WARMUP_RUNS, capture_graph, compiling_at_start_up, miss_worth_logging
from tts_core.accel.hift_graphs import capturable_istft
from tts_core.hift.causal import CausalHiftGenerator
from tts_core.hift.generator import Mix

log = structlog.get_logger(__name__)

DEFAULT_ROWS = (1, 2, 4, 8, 16, 32)


class _Bucket:
    """One graph: `rows` windows of `frames` mel frames in static buffers, their waveforms out."""

    def __init__(self, hift: CausalHiftGenerator, rows: int, frames: int, finalize: bool, dtype: torch.dtype,
                 device: torch.device, mix: Mix | None, warmup: int, pool, stream: torch.cuda.Stream) -> None:
        cfg = hift.cfg
        self.mel = torch.zeros(rows, cfg.in_channels, frames, dtype=dtype, device=device)
        self.source = torch.zeros(rows, 1, frames * cfg.samples_per_frame, dtype=dtype, device=device)
        self.graph = torch.cuda.CUDAGraph()
        self.wav = capture_graph(self.graph, lambda: hift.decode(self.mel, self.source, finalize, mix), warmup,
                                 pool=pool, stream=stream)

    def decode(self, mel: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        n = mel.size(0)
        self.mel[:n].copy_(mel)
        self.source[:n].copy_(source)
        self.graph.replay()
        # A copy: the next replay (of this graph, or another group's in the same render) rewrites the output.
        return self.wav[:n].clone()


class CausalHiftGraphs:
    """`decode(mel, source, finalize)` as `CausalHiftGenerator.decode`, replayed from graphs where captured.
    For one render lane: replays must not overlap (one lane's thread)."""

    def __init__(self, hift: CausalHiftGenerator, device: torch.device | str, mix: Mix | None = None) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise RuntimeError(f"CausalHiftGraphs needs a CUDA device, got {self.device}")
        self.hift, self.mix = hift, mix
        self.dtype = hift.stft_window.dtype  # the decoder's (the F0 predictor alone runs in float64)
        # (window frames, final) -> rows -> graph: a decode looks its window up once (the later lane holds ~150)
        self._buckets: dict[tuple[int, bool], dict[int, _Bucket]] = {}
        self.eager_calls = 0
        self._pool = None
        self._stream: torch.cuda.Stream | None = None

    @property
    def frames(self) -> list[int]:
        """The captured non-final window lengths (mel frames), ascending."""
        return sorted(frames for frames, final in self._buckets if not final)

    @property
    def final_frames(self) -> list[int]:
        """The captured final window lengths (mel frames), ascending."""
        return sorted(frames for frames, final in self._buckets if final)

    @torch.inference_mode()
    def capture(self, rows: Iterable[int] = DEFAULT_ROWS, frames: Iterable[int] = (), final_frames: Iterable[int] = (),
                warmup: int = WARMUP_RUNS) -> int:
        """Capture a graph per (row count, window frames) not captured yet, and one of one row per final window;
        returns how many it captured. `frames`: the non-final decoder windows of the caller's schedule
        (`decode_windows`); `final_frames`: its final ones (`final_window`)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        keys = {(r, f, False) for r in set(rows) for f in set(frames)} | {(1, f, True) for f in set(final_frames)}
        # Largest first: the later captures reuse its blocks of the instance's memory pool.
        wanted = sorted((k for k in keys if k[0] not in self._buckets.get(k[1:], {})),
                        key=lambda k: (k[0] * k[1], k), reverse=True)
        if any(r < 1 for r, _, _ in wanted) or any(f <= self.hift.conv_pre_look_right + 1 for _, f, _ in wanted):
            raise ValueError(f"CausalHiftGraphs: rows must be >= 1 and windows > {self.hift.conv_pre_look_right + 1} "
                             f"frames, got rows {sorted(set(rows))}, frames {sorted(set(frames))}, final frames "
                             f"{sorted(set(final_frames))}")
        with capturable_istft(), compiling_at_start_up(self.mix is not None):
            for r, f, final in wanted:
                self._buckets.setdefault((f, final), {})[r] = _Bucket(self.hift, r, f, final, self.dtype, self.device,
                                                                      self.mix, warmup, self._pool, self._stream)
        return len(wanted)

    @torch.inference_mode()
    def decode(self, mel: torch.Tensor, source: torch.Tensor, finalize: bool) -> torch.Tensor:
        """mel (B, 80, T) + source (B, 1, T x samples_per_frame) -> waveform (B, samples), as `hift.decode`."""
        n, frames = mel.size(0), mel.size(2)
        rows = self._buckets.get((frames, finalize))
        if mel.dtype != self.dtype or not rows:
            self.eager_calls += 1
            if miss_worth_logging(self.eager_calls):  # hundreds of launches instead of one: say so
                log.warning("hift_decode_eager", rows=n, frames=frames, final=finalize, eager_calls=self.eager_calls)
            return self.hift.decode(mel, source, finalize)
        top = max(rows)
        if n > top:
            return torch.cat([self.decode(mel[i:i + top], source[i:i + top], finalize) for i in range(0, n, top)])
        return rows[min(r for r in rows if r >= n)].decode(mel, source)
