"""CosyVoice3's pooled DiT attention kernel (tts_core/accel/dit_attention.py: the rotary on q and k, the context
read from the pool by index, the new keys and values written into it, one launch) against the generic path it
replaces (`dit_pool.pooled_sdpa`: rotate, gather, concatenate, scatter, SDPA with the additive chunk-causal
mask).

Where it runs: `tests/tts_core/kernel_host.py` (a CUDA host; a CPU under Triton's interpreter, fp32 only;
CI skips it). The captured-solve tests in test_dit_pool.py run the kernel inside whole solves."""

from __future__ import annotations

import pytest
import torch

from tests.tts_core.kernel_host import DEVICE, precisions, skip_unless_kernels_run

skip_unless_kernels_run()

from tts_core.flow.dit_pool import SolveIndex, pooled_sdpa  # noqa: E402

DTYPES = precisions(fp32=2e-5, bf16=3e-2, fp16=4e-3)

HEADS, HEAD_DIM = 4, 64


def _case(dtype: torch.dtype, chunk: int, n: int, ctx_lens: list[int], lengths: list[int], seed: int = 0):
    """Rows with `ctx_lens` real context frames each (0: a first chunk without shared frames; the last row,
    length 0, a bucket's padding row) and `lengths` real new frames of `n` from random start positions; random
    pool and q/k/v; the rotary's tables as the solve makes them."""
    gen = torch.Generator().manual_seed(seed)
    b, inner = len(ctx_lens), HEADS * HEAD_DIM
    frames = 40 + sum(ctx_lens) + b * n + 2
    zero, trash = frames - 2, frames - 1
    pool = torch.randn(2, 2, frames, inner, generator=gen).to(DEVICE, dtype)
    cap = max(ctx_lens) + 13  # padded context columns, as a bucket pads them
    ctx = torch.full((b, cap), zero, dtype=torch.long)
    write = torch.full((b, n), trash, dtype=torch.long)
    free = list(torch.randperm(frames - 2, generator=gen).tolist())  # context and kept frames, scattered
    for i, (c, length) in enumerate(zip(ctx_lens, lengths)):
        ctx[i, :c] = torch.tensor([free.pop() for _ in range(c)], dtype=torch.long)
        kept = length // chunk * chunk  # only whole chunks are kept
        write[i, :kept] = torch.tensor([free.pop() for _ in range(kept)], dtype=torch.long)
    ctx_ok = torch.arange(cap)[None] < torch.tensor(ctx_lens)[:, None]
    lengths_t = torch.tensor(lengths)
    qkv = torch.randn(2 * b, n, 3, inner, generator=gen).to(DEVICE, dtype)
    starts = torch.randint(0, 500, (b,), generator=gen)
    inv_freq = 1.0 / 10_000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
    angles = ((starts[:, None] + torch.arange(n)[None]).float()[..., None] * inv_freq).repeat_interleave(2, -1)
    angles = angles.repeat(2, 1, 1)  # (2B, N, dh): both guidance rows
    sign = torch.tensor([-1.0, 1.0]).repeat(HEAD_DIM // 2)
    cos, sin = angles.cos().to(dtype)[:, :, None].to(DEVICE), (angles.sin() * sign).to(dtype)[:, :, None].to(DEVICE)
    swap = torch.arange(HEAD_DIM).view(-1, 2).flip(-1).reshape(-1).to(DEVICE)
    valid = torch.arange(n)[None] < lengths_t[:, None]
    rel = torch.arange(n) // chunk
    see_new = (valid[:, None, :] & (rel[None, None, :] <= rel[None, :, None])) | torch.eye(n, dtype=torch.bool)[None]
    visible = torch.cat([ctx_ok[:, None, :].expand(-1, n, -1), see_new], dim=2)[:, None]
    bias = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).repeat(2, 1, 1, 1)
    index = SolveIndex(ctx.to(DEVICE), ctx_ok.sum(1).to(DEVICE), write.to(DEVICE), lengths_t.to(DEVICE), chunk,
                       cos, sin, swap, bias.to(DEVICE))
    return qkv, pool, index, write, trash


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("n,chunk", [(70, 50), (104, 50), (230, 50), (16, 8)])
def test_the_kernel_attends_and_keeps_as_the_generic_path(dtype: torch.dtype, tol: float, n: int, chunk: int) -> None:
    """Rows with a long context (not a multiple of the kernel's key block), none, and a padding row; new frames
    that end inside a chunk and past a query block: every query's output (padded ones included: they see
    themselves) matches rotate + gather + SDPA, the pool's kept frames hold the new (rotated) keys and the
    values (the first head's keys to rounding: the kernel rotates in fp32 and rounds once), nothing else moves."""
    from tts_core.accel.dit_graphs import fused_attention

    qkv, pool, index, write, trash = _case(dtype, chunk, n, ctx_lens=[130, 0, 77, 0], lengths=[n, n - 3, n // 2, 0])
    expected_pool, fused_pool = pool.clone(), pool.clone()
    expected = pooled_sdpa(qkv, expected_pool, index, HEADS)
    got = fused_attention(qkv, fused_pool, index, HEADS)
    assert torch.isfinite(got).all()
    scale = expected.float().abs().max().item()
    assert (got.float() - expected.float()).abs().max().item() <= tol * max(1.0, scale)
    kept = write[write != trash].to(DEVICE)
    assert kept.numel() > 0
    keys_fused, keys_expected = fused_pool[:, 0, kept], expected_pool[:, 0, kept]
    assert torch.equal(keys_fused[..., HEAD_DIM:], keys_expected[..., HEAD_DIM:])
    assert torch.allclose(keys_fused[..., :HEAD_DIM].float(), keys_expected[..., :HEAD_DIM].float(), rtol=tol, atol=tol)
    assert torch.equal(fused_pool[:, 1, kept], expected_pool[:, 1, kept])
    untouched = torch.ones(pool.size(2), dtype=torch.bool)
    untouched[kept.cpu()] = False
    untouched[trash] = False
    assert torch.equal(fused_pool[:, :, untouched.to(DEVICE)], pool[:, :, untouched.to(DEVICE)])
