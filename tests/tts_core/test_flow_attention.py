"""CosyVoice2's pooled flow attention kernel (tts_core/accel/flow_attention.py: the chunk-causal rule from frame
positions, the context's and the new frames' keys read where they lie, one launch) against the generic path it
replaces (`pooled_block.pooled_sdpa`: concatenate, SDPA with the call's additive mask made by
`pooled.attention_mask`).

Where it runs: `tests/tts_core/kernel_host.py` (a CUDA host; a CPU under Triton's interpreter, fp32 only;
CI skips it). The captured-solve tests in test_accel_cuda.py and test_golden_dtypes_cuda.py run the kernel
inside whole compiled solves against the golden streaming mels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.tts_core.kernel_host import DEVICE, precisions, skip_unless_kernels_run

skip_unless_kernels_run()

from tts_core.flow.pooled import additive_mask, attention_mask  # noqa: E402
from tts_core.flow.pooled_block import pooled_sdpa  # noqa: E402

DTYPES = precisions(fp32=2e-5, bf16=3e-2, fp16=4e-3)

HEADS, HEAD_DIM = 4, 64
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _positions(prefixes: list[int], owns: list[int], lengths: list[int], n: int, chunk: int, gen: torch.Generator):
    """Each row: a voice prefix [0, prefix), its own kept frames just before its start, `length` real new
    frames from that start (a chunk boundary, as calls start), the rest of the C + N columns padding (-1)."""
    cap = max(p + o for p, o in zip(prefixes, owns)) + 13  # padded context columns, as a bucket pads them
    key_pos = torch.full((len(prefixes), cap + n), -1, dtype=torch.long)
    new_pos = torch.full((len(prefixes), n), -1, dtype=torch.long)
    for i, (p, o, length) in enumerate(zip(prefixes, owns, lengths)):
        gap = int(torch.randint(0, 4, (1,), generator=gen)) * chunk  # own frames the ring no longer holds
        start = p + gap + o
        ctx = list(range(p)) + list(range(start - o, start))
        key_pos[i, :len(ctx)] = torch.tensor(ctx, dtype=torch.long)
        new_pos[i, :length] = torch.arange(start, start + length)
    key_pos[:, cap:] = new_pos
    counts = torch.tensor([p + o for p, o in zip(prefixes, owns)])
    return key_pos, new_pos, counts, cap


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,chunk,left", [(112, 50, -1), (56, 50, -1), (160, 50, 1), (16, 8, 0)])
def test_the_kernel_attends_as_sdpa_with_the_calls_mask(dtype: torch.dtype, tol: float, n: int, chunk: int,
                                                       left: int) -> None:
    """Rows with a prefix and own frames (a context not a multiple of the kernel's key block), a prefix only (a
    first chunk), no context at all, and a bucket's padding row; new frames that end inside a chunk and past a
    query block; the whole-context rule and a limited left context: every query's output (padded ones too:
    they see only themselves) matches SDPA over [context | new] with the mask the call builds."""
    from tts_core.accel.flow_attention import pooled_flow_attention

    gen = torch.Generator().manual_seed(n + chunk)
    prefixes, owns, lengths = [100, 100, 0, 0], [77, 0, 0, 0], [n, n - 3, n // 2, 0]
    key_pos, new_pos, counts, cap = _positions(prefixes, owns, lengths, n, chunk, gen)
    b, inner = len(prefixes), HEADS * HEAD_DIM
    qkv = torch.randn(2 * b, n, 3, inner, generator=gen).to(DEVICE, dtype)
    ctx_kv = torch.randn(2 * b, cap, 2, inner, generator=gen).to(DEVICE, dtype)
    index = SimpleNamespace(key_pos=key_pos.to(DEVICE), new_pos=new_pos.to(DEVICE), ctx_count=counts.to(DEVICE))
    mask = additive_mask(attention_mask(index, chunk, left), dtype)
    expected = pooled_sdpa(qkv, ctx_kv, mask, index, HEADS)
    got = pooled_flow_attention(qkv, ctx_kv, index.key_pos, index.new_pos, index.ctx_count, HEADS, chunk, left)
    assert torch.isfinite(got).all()
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= tol * max(1.0, scale)


def test_padding_context_columns_are_never_read() -> None:
    """A bucket's padded context columns (past a row's ctx_count) may hold anything, NaN included: the kernel
    does not load them (SDPA would have to mask them)."""
    from tts_core.accel.flow_attention import pooled_flow_attention

    gen = torch.Generator().manual_seed(3)
    key_pos, new_pos, counts, cap = _positions([100, 50], [50, 0], [112, 112], 112, 50, gen)
    qkv = torch.randn(4, 112, 3, HEADS * HEAD_DIM, generator=gen).to(DEVICE, HALF)
    ctx_kv = torch.randn(4, cap, 2, HEADS * HEAD_DIM, generator=gen).to(DEVICE, HALF)
    args = (key_pos.to(DEVICE), new_pos.to(DEVICE), counts.to(DEVICE), HEADS, 50, -1)
    clean = pooled_flow_attention(qkv, ctx_kv, *args)
    for row, count in enumerate(counts.tolist() * 2):
        ctx_kv[row, count:] = float("nan")
    assert torch.equal(pooled_flow_attention(qkv, ctx_kv, *args), clean)
