"""The fused flow feed-forward kernel (tts_core/accel/flow_feed_forward.py) against the estimator's
own modules, alone and inside the compiled pooled flow of the tiny golden model.

Needs Triton: on a CUDA host it runs for real; on CPU only under Triton's interpreter
(TRITON_INTERPRET=1 set before Triton is imported), which CI's CPU torch does not have, so CI skips
these. The CUDA tests (test_accel_cuda.py) run the captured flow graphs with it against golden."""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)

from tts_core.accel.flow_feed_forward import flow_feed_forward, use_fused_feed_forward
from tts_core.flow.estimator import TransformerBlock


def _block(dim: int, seed: int) -> TransformerBlock:
    torch.manual_seed(seed)
    block = TransformerBlock(dim, heads=2, head_dim=dim // 2).to(DEVICE)
    with torch.no_grad():
        for p in block.parameters():  # LayerNorm's ones/zeros would hide a wrong affine
            p.normal_(0.0, 0.2)
    return block


@pytest.mark.parametrize(("dim", "rows"), [(256, 112), (256, 700), (64, 5), (64, 33)])
def test_kernel_equals_the_blocks_feed_forward_half(dim: int, rows: int) -> None:
    """Row counts below and above the kernel's tile switch (512) and not multiples of the tile."""
    block = _block(dim, seed=rows)
    gen = torch.Generator().manual_seed(dim)
    x = torch.randn(2, rows, dim, generator=gen).to(DEVICE)
    attended = torch.randn(2, rows, dim, generator=gen).to(DEVICE)
    y = x + attended
    expected = block.ff(block.norm3(y), residual=y)
    first, second = block.ff.net[0].proj, block.ff.net[2]
    got = flow_feed_forward(x, attended, block.norm3.weight, block.norm3.bias, first.weight, first.bias,
                            second.weight, second.bias, block.norm3.eps)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)


def test_a_block_with_the_fused_feed_forward_equals_it_without() -> None:
    block = _block(64, seed=3)
    x = torch.randn(2, 40, 64, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    with torch.no_grad():
        expected = block(x, None)
        est = torch.nn.Module()
        est.block = block
        assert use_fused_feed_forward(est) == 1
        got = block(x, None)
        use_fused_feed_forward(est, on=False)
        again = block(x, None)
    torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)
    assert torch.equal(again, expected)  # off again: the modules' own path, bit for bit


def test_compiled_pooled_calls_with_the_fused_feed_forward_equal_the_eager_calls(tiny_model_dir) -> None:
    """compile_flow's estimator with the kernel (as the scheduler sets it up), on a first chunk at one
    row (the b = 2 specialization) and a batched call of two streams, then an eager call reading
    the frames both kept: each equals the eager pooled path."""
    from tts_core.accel.flow_pool_graphs import compiled_estimator
    from tts_core.flow import load_flow
    from tts_core.flow.context_pool import PoolShape
    from tts_core.flow.encoder_window import encode_grouped
    from tts_core.flow.pooled import PooledFlow, pooled_solve

    flow = load_flow(tiny_model_dir, DEVICE, torch.float32)
    speaker = next(iter(torch.load(tiny_model_dir / "spk2info.pt", weights_only=False).values()))
    tokens = torch.randint(0, 100, (1, 80), generator=torch.Generator().manual_seed(6)).to(DEVICE)
    compiled = compiled_estimator(flow.decoder.estimator, fused_feed_forward=True)
    results = []
    for estimator in (None, compiled):
        use_fused_feed_forward(flow.decoder.estimator, on=estimator is not None)
        pooled = PooledFlow(flow, PoolShape(stream_slots=3, stream_frames=400, voice_slots=2, voice_frames=100,
                                            prompt_frames=200))
        voice = pooled.register_voice(*(speaker[k].to(DEVICE) for k in ("flow_prompt_speech_token",
                                                                         "prompt_speech_feat", "flow_embedding")))
        a, b = pooled.open_stream(voice), pooled.open_stream(voice)
        outs = []
        for plans in ([pooled.plan(a, tokens[:, :28], False)],
                      [pooled.plan(a, tokens[:, :53], False), pooled.plan(b, tokens[:, :28], False)]):
            mus = encode_grouped(flow, plans)
            new = max(p.new_frames for p in plans)
            with torch.inference_mode():
                mel = pooled_solve(flow, pooled.pool, pooled.table([p.row for p in plans]),
                                   pooled.stack_mu(mus, len(plans), new), max(p.ctx_frames for p in plans),
                                   pooled.steps, estimator)
            streams = (a, b)[:len(plans)]
            outs += [pooled.finish(s, p, mel[i:i + 1, :, :p.new_frames]) for i, (s, p) in enumerate(zip(streams, plans))]
        use_fused_feed_forward(flow.decoder.estimator, on=False)  # eager from here, from what was kept
        outs.append(pooled.render([a], [tokens[:, :78]], [False])[0])
        results.append(outs)
    for eager, fused in zip(*results):
        assert eager.shape == fused.shape
        torch.testing.assert_close(fused, eager, atol=2e-4, rtol=2e-4)
