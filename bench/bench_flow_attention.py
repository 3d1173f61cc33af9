"""CosyVoice2's pooled flow attention alone, at the solve buckets' shapes: the Triton kernel
(tts_core/accel/flow_attention.py) in each launch configuration against SDPA with the call's additive mask (what
the compiled block ran before the kernel: cuDNN's flash kernel on the H100) and against `pooled_sdpa`
(concatenation + SDPA). Device time per call, one block and Euler step; 8 heads x 64, bf16.

    bash scripts/gpu_bench.sh python3 bench/bench_flow_attention.py --out $OUT/flow_attention.json

--one-stream: only one stream's shapes (a guidance pair of rows, as a lone call's solve has), with smaller query
blocks and fewer warps as well: with 128-query programs such a call gives the GPU 16-48 programs.

Needs CUDA and Triton.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import replay_ms  # noqa: E402
from tts_core.accel import flow_attention  # noqa: E402
from tts_core.flow.pooled import additive_mask, attention_mask  # noqa: E402
from tts_core.flow.pooled_block import pooled_sdpa  # noqa: E402

HEADS, HEAD_DIM, CHUNK = 8, 64, 50
# (rows, context frames, new frames): the later lane's largest buckets, a mid one, first chunks
SHAPES = ((32, 800, 112), (16, 400, 112), (32, 250, 160), (1, 800, 112), (1, 250, 160))
CONFIGS = [c for c in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4))]
# One stream: the first lanes' calls (a voice's shared prefix as context, a first hop's frames in a bucket of 16)
# and a later call of one stream.
ONE_STREAM_SHAPES = ((1, 250, 64), (1, 250, 112), (1, 250, 160), (1, 800, 112))
ONE_STREAM_CONFIGS = [c for c in itertools.product((16, 32, 64, 128), (32, 64), (1, 2, 4, 8), (2, 3))]


def case(rows: int, ctx: int, new: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(rows + ctx + new)
    key_pos = torch.cat([torch.arange(ctx), torch.arange(ctx, ctx + new)]).repeat(rows, 1)
    new_pos = torch.arange(ctx, ctx + new).repeat(rows, 1)
    index = SimpleNamespace(key_pos=key_pos.cuda(), new_pos=new_pos.cuda(), ctx_count=torch.full((rows,), ctx).cuda())
    inner = HEADS * HEAD_DIM
    qkv = torch.randn(2 * rows, new, 3, inner, generator=gen).to("cuda", dtype)
    ctx_kv = torch.randn(2 * rows, ctx, 2, inner, generator=gen).to("cuda", dtype)
    return qkv, ctx_kv, index, additive_mask(attention_mask(index, CHUNK, -1), dtype)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--one-stream", action="store_true", help="one stream's shapes, smaller programs as well")
    args = parser.parse_args(argv)
    shapes, configs = (ONE_STREAM_SHAPES, ONE_STREAM_CONFIGS) if args.one_stream else (SHAPES, CONFIGS)
    rows = []
    for shape in shapes:
        qkv, ctx_kv, index, mask = case(*shape, torch.bfloat16)
        q, k, v = qkv.unbind(2)
        k, v = torch.cat([ctx_kv[:, :, 0], k], 1), torch.cat([ctx_kv[:, :, 1], v], 1)
        split = [t.view(t.size(0), t.size(1), HEADS, -1).transpose(1, 2) for t in (q, k, v)]
        expected = pooled_sdpa(qkv, ctx_kv, mask, index, HEADS)
        row = {"rows": shape[0], "context": shape[1], "new": shape[2],
               "sdpa_mask_us": 1e3 * replay_ms(lambda: torch.nn.functional.scaled_dot_product_attention(
                   *split, attn_mask=mask)),
               "pooled_sdpa_us": 1e3 * replay_ms(lambda: pooled_sdpa(qkv, ctx_kv, mask, index, HEADS)),
               "kernel_us": {}}
        for config in configs:
            def run(config=config):
                return flow_attention.pooled_flow_attention(qkv, ctx_kv, index.key_pos, index.new_pos,
                                                            index.ctx_count, HEADS, CHUNK, -1, config)
            try:
                error = (run().float() - expected.float()).abs().max().item()
                row["kernel_us"][str(config)] = {"us": 1e3 * replay_ms(run), "max_abs_error": error}
            except Exception as exc:  # a configuration the compiler refuses (shared memory): noted, skipped
                row["kernel_us"][str(config)] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
        timed = {c: r["us"] for c, r in row["kernel_us"].items() if "us" in r}
        row["best_config"] = min(timed, key=timed.get)
        default = str(flow_attention.launch_config(2 * shape[0], shape[2]))
        print(f"{shape}: sdpa+mask {row['sdpa_mask_us']:.1f} us, pooled_sdpa {row['pooled_sdpa_us']:.1f} us, "
              f"kernel default {timed.get(default, float('nan')):.1f} us, "
              f"best {row['best_config']} {timed[row['best_config']]:.1f} us", flush=True)
        rows.append(row)
    best_overall = min((str(c) for c in configs),
                       key=lambda c: sum(r["kernel_us"][c].get("us", float("inf")) / r["sdpa_mask_us"] for r in rows))
    command = ("bash scripts/gpu_bench.sh python3 bench/bench_flow_attention.py --out $OUT/flow_attention.json"
               + (" --one-stream" if args.one_stream else ""))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "heads": HEADS,
              "head_dim": HEAD_DIM, "rows": rows, "best_config_over_shapes": best_overall, "command": command}
    for r in rows:
        print(f"  {best_overall} at {(r['rows'], r['context'], r['new'])}: {r['kernel_us'][best_overall]}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
