"""GPU runners of tts_core.accel on the tiny golden model: replay equals the eager module calls.
Skipped where no CUDA device is present (CI); the full-size timings live in bench/bench_components.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_graphed_decode_steps_equal_eager_steps(tiny_model_dir: Path) -> None:
    from tts_core.accel.lm_graphs import GraphedDecoder
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, "cuda", torch.float32)
    cache = lm.setup_cache(9, 96)
    live = [3, 0, 5]
    gen = torch.Generator().manual_seed(0)
    inputs = [lm.build_prefill_input(torch.randint(0, 100, (5 + 3 * i,), generator=gen).tolist()) for i in live]
    lm.prefill(live, inputs)
    snap = cache.snapshot()
    tokens = torch.randint(0, lm.speech_token_size, (3, len(live)), generator=gen)
    eager = [lm.decode_step(live, t.tolist()).clone() for t in tokens]
    dec = GraphedDecoder(lm, (1, 2, 4, 8), (32, 96))
    cache.restore(snap)
    for t, expected in zip(tokens, eager):
        kv = int(cache.lengths[live].max())
        got = dec.step(live, t.tolist(), kv_len=kv)
        assert torch.allclose(got, expected, atol=1e-4)
    assert int(cache.lengths[dec.scratch_slot]) <= 8  # padding never runs the scratch row off the cache
