"""The slot-reading decode attention kernel (tts_core/accel/decode_attention.py) against the
generic path (gather the rows' cache columns, SDPA with the length mask).

Needs Triton: on a CUDA host it runs for real; on CPU only under Triton's interpreter
(TRITON_INTERPRET=1 set before Triton is imported, with the `triton` package installed), which CI's
CPU torch does not have, so CI skips these. The graphed decode test in test_accel_cuda.py covers the
kernel inside captured, compiled decode steps on the GPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from tts_core.accel.decode_attention import decode_attention
from tts_core.llm.kv_cache import StaticKVCache


def _filled_cache(layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                  seed: int) -> StaticKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = StaticKVCache(layers, max_batch, kv_heads, max_len, head_dim, device=DEVICE, dtype=dtype)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 2, 16), (8, 8, 32)])
def test_kernel_equals_gathered_sdpa_at_every_row_length(heads: int, kv_heads: int, head_dim: int) -> None:
    """Rows of mixed lengths (one column, a partial block, several blocks, the whole cache), slots
    in any order and one slot twice: each row attends to exactly its own columns 0..position."""
    max_len = 200
    cache = _filled_cache(1, 6, kv_heads, max_len, head_dim, torch.float32, seed=1)
    slots = torch.tensor([4, 0, 2, 5, 4], device=DEVICE)
    positions = torch.tensor([[0], [37], [64], [199], [130]], device=DEVICE)
    q = torch.randn(5, heads, 1, head_dim, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = cache.attention_mask(positions, max_len)
    expected = cache.attend(0, q, slots, positions, mask, grouped=kv_heads != heads)
    got = decode_attention(q, cache.keys[0], cache.values[0], slots, positions[:, 0])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    # Columns past a row's position must not count: changing them changes nothing.
    cache.keys[0][0, :, 38:] += 100.0
    cache.values[0][0, :, 38:] -= 100.0
    again = decode_attention(q, cache.keys[0], cache.values[0], slots, positions[:, 0])
    torch.testing.assert_close(again, got, atol=0, rtol=0)


def test_the_cache_attends_with_the_kernel_when_set_and_prefill_rows_keep_the_generic_path() -> None:
    cache = _filled_cache(2, 4, 2, 96, 16, torch.float32, seed=3)
    slots = torch.tensor([1, 3], device=DEVICE)
    gen = torch.Generator().manual_seed(4)
    one = torch.tensor([[40], [7]], device=DEVICE)
    q1 = torch.randn(2, 4, 1, 16, generator=gen).to(DEVICE)
    many = torch.tensor([[5, 6, 7], [60, 61, 62]], device=DEVICE)
    q3 = torch.randn(2, 4, 3, 16, generator=gen).to(DEVICE)
    generic = [cache.attend(1, q, slots, pos, cache.attention_mask(pos, 96), grouped=True)
               for q, pos in ((q1, one), (q3, many))]
    calls: list[int] = []

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return decode_attention(*args)

    cache.decode_attention = counting
    with_kernel = [cache.attend(1, q, slots, pos, cache.attention_mask(pos, 96), grouped=True)
                   for q, pos in ((q1, one), (q3, many))]
    assert len(calls) == 1  # the one-token rows only
    for got, expected in zip(with_kernel, generic):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_a_compiled_decode_step_with_the_kernel_equals_the_eager_generic_step(tiny_model_dir: Path) -> None:
    """The kernel inside torch.compile (as GraphedDecoder compiles the step): the cache writes stay
    in place ahead of it and the step's log-probabilities match the generic eager step."""
    from tts_core.accel.lm_graphs import _decode_step
    from tts_core.model_dir import load_speech_lm

    lm = load_speech_lm(tiny_model_dir, DEVICE, torch.float32)
    cache = lm.setup_cache(6, 64)
    live = [4, 1]
    gen = torch.Generator().manual_seed(5)
    lm.prefill(live, [lm.build_prefill_input(torch.randint(0, 100, (4 + 5 * i,), generator=gen).tolist())
                      for i in range(len(live))])
    snap = cache.snapshot()
    tokens = torch.randint(0, lm.speech_token_size, (3, len(live)), generator=gen)
    eager = [lm.decode_step(live, t.tolist()).clone() for t in tokens]
    cache.restore(snap)
    cache.decode_attention = decode_attention
    step = torch.compile(_decode_step, dynamic=True)
    slots = torch.tensor(live, device=DEVICE)
    with torch.inference_mode():
        for t, expected in zip(tokens, eager):
            got = step(lm, slots, t.to(DEVICE), attend_len=64)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.lengths[live].tolist() == snap[2][live].add(3).tolist()
