"""The decode step's attention kernel (tts_core/accel/decode_attention.py: rotary, cache write and
attention by slot in one launch) against the generic path (rotary, `StaticKVCache.write`, gather
the rows' cache columns, SDPA with the length mask).

Where it runs: `tests/tts_core/kernel_host.py` (a CUDA host; a CPU under Triton's interpreter; CI skips it). The graphed
decode test in test_accel_cuda.py covers the kernel inside captured, compiled decode steps on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.tts_core.kernel_host import DEVICE, skip_unless_kernels_run

skip_unless_kernels_run()

from tts_core.accel.decode_attention import decode_attention  # noqa: E402
from tts_core.llm.kv_cache import StaticKVCache  # noqa: E402
from tts_core.llm.rotary import RotaryEmbedding  # noqa: E402


def _filled_cache(layers: int, max_batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: torch.dtype,
                  seed: int) -> StaticKVCache:
    gen = torch.Generator().manual_seed(seed)
    cache = StaticKVCache(layers, max_batch, kv_heads, max_len, head_dim, device=DEVICE, dtype=dtype)
    for t in cache.keys + cache.values:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


def _step_inputs(b: int, heads: int, kv_heads: int, head_dim: int, positions: torch.Tensor, seed: int,
                 dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, n, positions.size(1), head_dim, generator=gen).to(DEVICE, dtype)
               for n in (heads, kv_heads, kv_heads))
    cos, sin = RotaryEmbedding(head_dim, 10000.0).to(DEVICE)(positions, dtype)
    return q, k, v, cos, sin


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 2, 16), (8, 8, 32)])
def test_kernel_equals_the_generic_step_at_every_row_length(heads: int, kv_heads: int, head_dim: int) -> None:
    """Rows of mixed lengths (only its own new column, a partial block, several blocks, the whole
    cache) in slots in any order: each row writes its rotated key and value at its position and
    attends to exactly its own columns 0..position."""
    max_len = 200
    generic = _filled_cache(1, 6, kv_heads, max_len, head_dim, torch.float32, seed=1)
    fused = _filled_cache(1, 6, kv_heads, max_len, head_dim, torch.float32, seed=1)
    slots = torch.tensor([4, 0, 2, 5, 1], device=DEVICE)
    positions = torch.tensor([[0], [37], [64], [199], [130]], device=DEVICE)
    q, k, v, cos, sin = _step_inputs(5, heads, kv_heads, head_dim, positions, seed=2)
    mask = generic.attention_mask(positions, max_len)
    expected = generic.write_and_attend(0, q, k, v, (cos, sin), slots, positions, mask, grouped=kv_heads != heads)
    got = decode_attention(q, k, v, cos, sin, fused.keys[0], fused.values[0], slots, positions[:, 0])
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(fused.keys[0], generic.keys[0], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(fused.values[0], generic.values[0], atol=0, rtol=0)
    # Columns past a row's position must not count: changing them changes nothing.
    fused.keys[0][0, :, 38:] += 100.0
    fused.values[0][0, :, 38:] -= 100.0
    again = decode_attention(q, k, v, cos, sin, fused.keys[0], fused.values[0], slots, positions[:, 0])
    torch.testing.assert_close(again, got, atol=0, rtol=0)


# bf16 as served on the GPU. Triton's CPU interpreter gets bf16 matrix products wrong (outputs of
# 1e8 from inputs of 1), so there the same half-precision check runs in fp16.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16


def test_half_precision_rows_match_the_generic_step_within_its_rounding() -> None:
    """The kernel rotates in fp32 and rounds once where the generic path rounds after each
    product, so the two differ by half-precision rounding only."""
    generic = _filled_cache(1, 4, 2, 256, 64, HALF, seed=6)
    fused = _filled_cache(1, 4, 2, 256, 64, HALF, seed=6)
    slots = torch.tensor([3, 1, 0], device=DEVICE)
    positions = torch.tensor([[5], [130], [255]], device=DEVICE)
    q, k, v, cos, sin = _step_inputs(3, 14, 2, 64, positions, seed=7, dtype=HALF)
    expected = generic.write_and_attend(0, q, k, v, (cos, sin), slots, positions,
                                        generic.attention_mask(positions, 256), grouped=True)
    got = decode_attention(q, k, v, cos, sin, fused.keys[0], fused.values[0], slots, positions[:, 0])
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused.keys[0].float(), generic.keys[0].float(), atol=2e-2, rtol=2e-2)


def test_the_cache_uses_the_kernel_when_set_and_prefill_rows_keep_the_generic_path() -> None:
    generic = _filled_cache(2, 4, 2, 96, 16, torch.float32, seed=3)
    with_kernel = _filled_cache(2, 4, 2, 96, 16, torch.float32, seed=3)
    slots = torch.tensor([1, 3], device=DEVICE)
    one = torch.tensor([[40], [7]], device=DEVICE)
    many = torch.tensor([[5, 6, 7], [60, 61, 62]], device=DEVICE)
    calls: list[int] = []

    def counting(*args: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return decode_attention(*args)

    with_kernel.decode_attention = counting
    for seed, pos in ((4, one), (5, many)):
        q, k, v, cos, sin = _step_inputs(2, 4, 2, 16, pos, seed=seed)
        expected, got = (cache.write_and_attend(1, q, k, v, (cos, sin), slots, pos, cache.attention_mask(pos, 96),
                                                grouped=True) for cache in (generic, with_kernel))
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert len(calls) == 1  # the one-token rows only
    torch.testing.assert_close(with_kernel.keys[1], generic.keys[1], atol=1e-6, rtol=1e-6)


def test_a_compiled_decode_step_with_the_kernel_equals_the_eager_generic_step(tiny_model_dir: Path) -> None:
    """The kernel inside torch.compile (as GraphedDecoder compiles the step): its cache writes land
    in the cache itself and the step's log-probabilities match the generic eager step."""
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
    eager_keys, eager_values, _ = cache.snapshot()
    cache.restore(snap)
    cache.decode_attention = decode_attention
    step = torch.compile(_decode_step, dynamic=True)
    slots = torch.tensor(live, device=DEVICE)
    with torch.inference_mode():
        for t, expected in zip(tokens, eager):
            got = step(lm, slots, t.to(DEVICE), attend_len=64)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert cache.lengths[live].tolist() == snap[2][live].add(3).tolist()
    # The kernel's writes landed in the cache tensors themselves (not in a copy the compiler made).
    for got, expected in zip(cache.keys + cache.values, eager_keys + eager_values):
        torch.testing.assert_close(got[live], expected[live], atol=1e-5, rtol=1e-5)
