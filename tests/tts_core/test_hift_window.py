"""CosyVoice3's causal HiFT chunk by chunk over a bounded window (tts_core/hift/causal_window.py): each
chunk's samples are those the official whole-mel re-run emits (golden token2wav calls; random mel over
many chunks, in float64 to show the window loses nothing), while every call decodes at most the chunk
plus the stated left context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.hift.causal import CausalHiftGenerator, load_causal_hift
from tts_core.hift.causal_window import HiftWindows

# float32: a decoder run over another length rounds differently (measured <= 3e-4 on this random tiny HiFT,
# spread over the whole signal wherever the window starts, so rounding, not reach); float64 shows the rest.
WAV_TOL = 1e-3
WAV_MEAN_TOL = 1e-5
EXACT_TOL = 1e-9


@pytest.fixture(scope="module")
def stream_case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "token2wav_stream.pt", weights_only=False)


def _hift(tiny3_model_dir: Path, dtype: torch.dtype) -> CausalHiftGenerator:
    torch.set_num_threads(1)
    hift = load_causal_hift(tiny3_model_dir)  # float32, its F0 predictor float64 as the official runs it
    if dtype != torch.float32:
        for p in hift.parameters():  # not the buffers: the 300-s noise stays float32 and is cast per slice
            p.data = p.data.to(dtype)
        hift.stft_window = hift.stft_window.to(dtype)
    return hift


def _stream(hift: CausalHiftGenerator, mel: torch.Tensor, calls: list[tuple[int, bool]]
            ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """Per (mel frames, finalize): (our chunk, the whole-mel run's new samples, frames our decoder read)."""
    windows = HiftWindows(hift, 1, 15000, torch.device("cpu"))
    decode, read = hift.decode, []

    def counting(m, source, finalize):
        read.append(m.size(2))
        return decode(m, source, finalize)

    hift.decode = counting
    out, emitted = [], 0
    try:
        for frames, finalize in calls:
            chunk, known = windows.render(0, mel[:, :, :frames], emitted, finalize)
            ours_read = read[-1]
            windows.commit(0, known)
            whole, _ = hift.inference(mel[:, :, :frames], finalize)
            out.append((chunk, whole[:, emitted:], ours_read))
            emitted += chunk.size(1)
    finally:
        del hift.decode
    return out


def test_golden_chunks_equal_the_official_whole_mel_runs(tiny3_model_dir: Path, stream_case: dict) -> None:
    """The golden token2wav calls (mel so far 50 / 150 / 180 frames): each chunk equals the new samples of
    the whole-mel run and the official chunk."""
    hift = _hift(tiny3_model_dir, torch.float32)
    calls = [(c["hift_mel_frames"], c["hift_finalize"]) for c in stream_case["calls"]]
    got = _stream(hift, stream_case["hift_mel_final"], calls)
    for (ours, whole, _), official in zip(got, stream_case["chunks"], strict=True):
        assert ours.shape == whole.shape == official.shape
        assert (ours - whole).abs().max().item() <= WAV_TOL
        assert (ours - official).abs().mean().item() <= WAV_MEAN_TOL


def test_many_chunks_are_exact_and_each_decodes_a_bounded_window(tiny3_model_dir: Path) -> None:
    """In float64 (rounding out of the way) a 900-frame mel streamed in 11 chunks of 50-100 frames gives the
    whole-mel runs' samples to 1e-9, while the decoder reads at most the chunk plus `left` + 8 frames (not
    all the mel so far)."""
    hift = _hift(tiny3_model_dir, torch.float64)
    gen = torch.Generator().manual_seed(0)
    mel = torch.randn(1, 80, 900, generator=gen, dtype=torch.float64) * 2
    ends, frames = [], 0
    for hop in [50] + [100] * 7 + [75, 50, 25]:
        frames = min(900, frames + hop)
        ends.append((frames, frames == 900))
    got = _stream(hift, mel, ends)
    left = HiftWindows(hift, 1, 10, torch.device("cpu")).left
    previous = 0
    for (ours, whole, read), (end, _) in zip(got, ends):
        assert ours.shape == whole.shape
        assert (ours - whole).abs().max().item() <= EXACT_TOL
        assert read <= end - previous + left + 8
        previous = end
    assert max(read for _, _, read in got) < 900 // 3
