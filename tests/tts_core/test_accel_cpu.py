"""CPU-runnable logic of tts_core.accel: bucket choice, dtype names, the batched RAS sampler's
distribution and the capturable istft's equality with torch.istft."""

from __future__ import annotations

import pytest
import torch

from tts_core.accel import resolve_dtype, select_bucket
from tts_core.accel.buckets import smallest_solve_bucket, solve_keys_largest_first
from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.accel.buckets import power_of_two_buckets
from tts_core.accel.hift_graphs import overlap_add_istft
from tts_core.llm.sampling import SamplingConfig

SPEECH = 6561
VOCAB = SPEECH + 3


def test_smallest_fitting_bucket_is_chosen() -> None:
    buckets = power_of_two_buckets(128)
    assert buckets == (1, 2, 4, 8, 16, 32, 64, 128)
    assert [select_bucket(n, buckets) for n in (1, 2, 3, 5, 17, 128)] == [1, 2, 4, 8, 32, 128]
    assert power_of_two_buckets(100)[-1] == 100


def test_a_batch_beyond_the_largest_bucket_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        select_bucket(129, (1, 64, 128))
    with pytest.raises(ValueError):
        select_bucket(0, (1, 2))


def test_a_flow_solve_takes_the_cheapest_bucket_it_fits_and_none_when_it_fits_none() -> None:
    """The flow graphs' buckets (rows, context, new frames): captured costliest first (the first graph's memory
    serves the rest); a call replays the cheapest one holding all its rows and frames, or runs eagerly."""
    keys = solve_keys_largest_first((1, 4), (100, 300), (50,))
    assert keys == [(4, 300, 50), (4, 100, 50), (1, 300, 50), (1, 100, 50)]
    assert smallest_solve_bucket(keys, 1, 80, 50) == (1, 100, 50)
    assert smallest_solve_bucket(keys, 2, 80, 50) == (4, 100, 50)
    assert smallest_solve_bucket(keys, 1, 120, 40) == (1, 300, 50)
    assert smallest_solve_bucket(keys, 5, 80, 50) is None
    assert smallest_solve_bucket(keys, 1, 80, 51) is None


def test_dtype_names() -> None:
    assert resolve_dtype("bf16") is torch.bfloat16
    assert resolve_dtype("FP16") is torch.float16
    assert resolve_dtype(torch.float32) is torch.float32
    with pytest.raises(ValueError, match="bf16"):
        resolve_dtype("int8")


def _peaked(rows: int, stop_mass: float = 0.0) -> torch.Tensor:
    probs = torch.full((rows, VOCAB), 1e-9)
    probs[:, :4] = torch.tensor([0.5, 0.25, 0.15, 0.10]) * (1 - stop_mass)
    probs[:, SPEECH] = stop_mass
    return probs.log().log_softmax(-1)


def test_nucleus_draws_follow_top_p() -> None:
    # Mass before the 4th token is 0.9 >= top_p 0.8, so only the first three are drawn, renormalised.
    gen = torch.Generator().manual_seed(0)
    sampler = BatchedRasSampler(SamplingConfig(), SPEECH)
    draws = sampler.sample(_peaked(6000), torch.full((6000, 10), -1), torch.ones(6000, dtype=torch.bool), gen)
    freq = torch.bincount(draws, minlength=4)[:4].float() / 6000
    assert torch.allclose(freq, torch.tensor([0.5, 0.25, 0.15, 0.0]) / 0.9, atol=0.03)


def test_a_repeated_pick_is_redrawn_from_the_full_distribution() -> None:
    # Token 0 fills the window: a nucleus pick of 0 (p 5/9) is replaced by a draw from the full
    # distribution, so P(3) = 5/9 * 0.10 although 3 is outside the nucleus.
    gen = torch.Generator().manual_seed(1)
    sampler = BatchedRasSampler(SamplingConfig(), SPEECH)
    draws = sampler.sample(_peaked(6000), torch.zeros(6000, 10, dtype=torch.long),
                           torch.ones(6000, dtype=torch.bool), gen)
    freq = torch.bincount(draws, minlength=4)[:4].float() / 6000
    expected = torch.tensor([5 / 9 * 0.5, 0.25 / 0.9 + 5 / 9 * 0.25, 0.15 / 0.9 + 5 / 9 * 0.15, 5 / 9 * 0.10])
    assert torch.allclose(freq, expected, atol=0.03)


def test_stop_tokens_are_rejected_before_the_minimum_length_only() -> None:
    gen = torch.Generator().manual_seed(2)
    sampler = BatchedRasSampler(SamplingConfig(), SPEECH)
    logp = _peaked(2000, stop_mass=0.6)  # eos is the most likely token
    history = torch.full((2000, 10), -1)
    early = sampler.sample(logp, history, torch.zeros(2000, dtype=torch.bool), gen)
    late = sampler.sample(logp, history, torch.ones(2000, dtype=torch.bool), gen)
    assert int((early >= SPEECH).sum()) == 0
    assert 0.4 < float((late >= SPEECH).float().mean()) < 0.9


def test_capturable_istft_equals_torch_istft() -> None:
    window = torch.hann_window(16, periodic=True)
    gen = torch.Generator().manual_seed(3)
    spec = torch.stft(torch.randn(2, 16 * 40, generator=gen), 16, 4, 16, window=window, return_complex=True)
    spec = spec * torch.exp(0.3j * torch.randn(spec.shape, generator=gen))  # not a consistent STFT
    expected = torch.istft(spec, 16, 4, 16, window=window)
    assert torch.allclose(overlap_add_istft(spec, 16, 4, 16, window=window), expected, atol=1e-5)



def test_graphs_of_the_eager_modules_are_counted_without_importing_the_compiler() -> None:
    """Start-up before ready records graphs of the eager modules only: the capture counters and the
    compile settings must not import torch._dynamo (seconds of a worker's start), and its figures
    read zero until something compiles."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from tts_core.accel.graph_capture import CaptureClock, charge, compiling_at_start_up\n"
            "before = CaptureClock.now()\n"
            "with compiling_at_start_up(False):\n"
            "    charge(0.0, 0.0, 3)\n"
            "figures = CaptureClock.now().since(before)\n"
            "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo was imported'\n"
            "assert figures['graphs'] == 3 and figures['compile_s'] == 0.0 and figures['compiles'] == 0, figures\n"
            "with compiling_at_start_up():\n"
            "    pass\n"
            "assert 'torch._dynamo' in sys.modules\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
