"""push_chunks: many streams' chunks through bucketed HiFT calls give each stream exactly what its own
HiftStream gives (caches, cross-fade, held-back tail, finals), whatever the grouping.

The graphs here are stand-ins with GraphedHift's interface that run the real tiny vocoder eagerly,
row by row, drawing every row's excitation from a generator seeded 0 (a captured graph draws from
the device's generator, so its noise cannot be matched on CPU). The reference streams reseed their
own generator to 0 before each chunk: both sides then vocode with the same excitation, and any
difference is the batching glue's. The captured graphs themselves are checked on CUDA
(tests/tts_core/test_accel_cuda.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from tts_core.hift import HiftGenerator, HiftStream, load_hift
from tts_core.runtime.chunk_vocoder import ChunkVocoder, push_chunks


class RowwiseHift:
    """GraphedHift's interface (rows, frames, cached samples), eager and seeded per row."""

    def __init__(self, vocoder: HiftGenerator, rows: int, frames: int, cache_samples: int) -> None:
        self.vocoder, self.rows, self.frames, self.cache_samples = vocoder, rows, frames, cache_samples
        self.replays: list[int] = []  # rows used per replay

    def inference(self, mel: torch.Tensor, cache_source: torch.Tensor | None):
        assert mel.size(0) <= self.rows and mel.size(-1) == self.frames
        assert (cache_source is None) == (self.cache_samples == 0)
        self.replays.append(mel.size(0))
        wavs, sources = [], []
        for r in range(mel.size(0)):
            cache = None if cache_source is None else cache_source[r:r + 1]
            wav, source = self.vocoder.inference(mel[r:r + 1], cache, torch.Generator().manual_seed(0))
            wavs.append(wav)
            sources.append(source)
        return torch.cat(wavs), torch.cat(sources)


@pytest.fixture(scope="module")
def vocoder(tiny_model_dir: Path) -> HiftGenerator:
    return load_hift(tiny_model_dir)


def _reference(vocoder: HiftGenerator, chunks: list[torch.Tensor], finals: list[bool]) -> list[torch.Tensor]:
    gen = torch.Generator()
    stream = HiftStream(vocoder, gen)
    out = []
    for mel, fin in zip(chunks, finals):
        gen.manual_seed(0)
        out.append(stream.push(mel, fin))
    return out


def test_bucketed_chunks_equal_each_streams_own_vocoder(vocoder: HiftGenerator) -> None:
    torch.manual_seed(3)
    mel_dim, cache = vocoder.cfg.in_channels, 8 * vocoder.cfg.samples_per_frame
    # Five streams: first chunks of 20 frames, then 12-frame later chunks, then finals of 4..12
    # frames (two of one length, so a final may share a bucket; one as long as a later chunk).
    finals = [4, 6, 6, 9, 12]
    plans = [[torch.randn(1, mel_dim, n) for n in (20, 12, 12, f)] for f in finals]
    graphs = {(4, 20, 0): RowwiseHift(vocoder, 4, 20, 0), (1, 20, 0): RowwiseHift(vocoder, 1, 20, 0),
              (2, 20, 0): RowwiseHift(vocoder, 2, 20, 0),
              (4, 20, cache): RowwiseHift(vocoder, 4, 20, cache), (1, 14, cache): RowwiseHift(vocoder, 1, 14, cache)}
    streams = [ChunkVocoder(vocoder, torch.Generator().manual_seed(0)) for _ in plans]
    got: list[list[torch.Tensor]] = [[] for _ in plans]
    with capture_logs() as logs:
        for step in range(4):
            last = step == 3
            # The eager fallback (no graph of the shape) must draw the same noise as the reference.
            for s in streams:
                s.generator.manual_seed(0)
            wavs = push_chunks(streams, [p[step] for p in plans], [last] * len(plans), graphs)
            for g, w in zip(got, wavs):
                g.append(w)
    # Each chunk that found no graph of its shape is logged with that shape (an operator's sign of a schedule
    # the captured set does not cover): the lone later chunk, and the finals of 4, 9 and 12 frames.
    eager = {(e["frames"], e["cached"]) for e in logs if e["event"] == "hift_chunk_eager"}
    assert eager == {(8 + 12, cache), (8 + 4, cache), (8 + 9, cache)}
    for plan, fin_frames, mine in zip(plans, finals, got):
        want = _reference(vocoder, plan, [False, False, False, True])
        for a, b in zip(mine, want):
            assert a.shape == b.shape
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    # 5 first chunks: one replay of the 4-row bucket + one stream alone on the 1-row graph;
    # 5 later chunks (8 cached + 12 = 20 frames): 4 + 1, the last eagerly (no 1-row graph of it);
    # the 6-frame finals (14 frames with the cache) share nothing bigger than one row.
    assert graphs[(4, 20, 0)].replays == [4] and graphs[(1, 20, 0)].replays == [1]
    assert graphs[(4, 20, cache)].replays == [4, 4] and graphs[(2, 20, 0)].replays == []
    assert graphs[(1, 14, cache)].replays == [1, 1]
