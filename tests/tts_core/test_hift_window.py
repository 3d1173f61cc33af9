"""CosyVoice3's causal HiFT chunk by chunk over a bounded window (tts_core/hift/causal_window.py): each
chunk's samples are those the official whole-mel re-run emits (golden token2wav calls; random mel over
many chunks, in float64 to show the window loses nothing), while every call decodes at most the chunk
plus the stated left context."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.hift.causal import CausalHiftGenerator, load_causal_hift
from tts_core.hift.causal_window import HiftWindows, decode_windows

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


def _schedules(hift: CausalHiftGenerator) -> list[dict]:
    """Five streams at different stages, sizes from the model's reach: three of one schedule (two in step,
    one two rounds behind), one of another hop ending in a short final chunk, one a single final chunk."""
    left, look = HiftWindows(hift, 1, 1, torch.device("cpu")).left, hift.look_ahead_frames
    first, hop, other = look + left // 2, left, left + left // 2 + 1

    def ends(first: int, hop: int, total: int) -> list[int]:
        out = [first]
        while out[-1] < total:
            out.append(min(total, out[-1] + hop))
        return out

    steady = ends(first, hop, first + 6 * hop)
    return [{"ends": steady, "round": 0}, {"ends": steady, "round": 0}, {"ends": steady, "round": 2},
            {"ends": ends(first + 1, other, first + 3 * other + left // 3), "round": 1},
            {"ends": [2 * look + left // 2], "round": 3}]


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float64, EXACT_TOL), (torch.float32, WAV_TOL)])
def test_batched_windows_equal_each_stream_rendered_alone(tiny3_model_dir: Path, dtype: torch.dtype,
                                                          tol: float) -> None:
    """render_many over streams at different stages (first, steady and final chunks, different lengths)
    gives each stream the samples, F0 and phase state that rendering it alone gives, while calls with
    equal decoder windows share one decode of stacked rows (and non-final windows are those
    `decode_windows` lists for the schedule)."""
    hift = _hift(tiny3_model_dir, dtype)
    streams = _schedules(hift)
    gen = torch.Generator().manual_seed(1)
    mels = [torch.randn(1, hift.cfg.in_channels, s["ends"][-1], generator=gen, dtype=dtype) * 2 for s in streams]
    alone, batched = (HiftWindows(hift, len(streams), 1000, torch.device("cpu")) for _ in range(2))
    batched.decode_rows = 2  # the three steady streams' group splits too
    emitted = [0] * len(streams)
    decode, rows = hift.decode, []

    def counting(m, source, finalize):
        rows.append((m.size(0), m.size(2), finalize))
        return decode(m, source, finalize)

    rounds = max(s["round"] + len(s["ends"]) for s in streams)
    shared = []
    for r in range(rounds):
        calls = [(i, mels[i][:, :, :s["ends"][r - s["round"]]], emitted[i], r - s["round"] == len(s["ends"]) - 1)
                 for i, s in enumerate(streams) if 0 <= r - s["round"] < len(s["ends"])]
        expected = [alone.render(*call) for call in calls]
        hift.decode, rows[:] = counting, []
        try:
            got = batched.render_many(calls)
        finally:
            del hift.decode
        shared += [n for n, _, _ in rows if n > 1]
        assert sum(n for n, _, _ in rows) == len(calls)
        for (slot, mel, _, finalize), (wav, known), (want, want_known) in zip(calls, got, expected, strict=True):
            assert wav.shape == want.shape and known == want_known
            assert (wav - want).abs().max().item() <= tol
            alone.commit(slot, known)
            batched.commit(slot, known)
            emitted[slot] += wav.size(1)
        for n, frames, finalize in rows:
            assert finalize or frames in {w for s in streams for w in decode_windows(hift, s["ends"][:-1])}
    assert len(shared) >= 3  # first chunks in step, steady chunks of streams rounds apart, finals in step
    assert max(shared) == 2
    assert all(emitted[i] == s["ends"][-1] * hift.cfg.samples_per_frame for i, s in enumerate(streams))
    # the kept F0 and phase increments: equal but for rounding (the float64 F0 predictor's batched
    # convolution rounds at 1e-13 Hz)
    torch.testing.assert_close(batched.f0, alone.f0)
    torch.testing.assert_close(batched.increments, alone.increments)
