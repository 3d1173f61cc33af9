"""CosyVoice3's pooled DiT solve alone on the GPU: what one batched render call of R streams costs, and where
its kernels' time goes. Full-size DiT (random weights from bench/full_model.py --family 3), CUDA.

For each (rows, new frames) it times, on the device (CUDA events, METHOD.md), the solve replayed from a CUDA graph
with the attention as gather + SDPA (`sdpa`) or as the fused pool kernel (`fused`, tts_core/accel/dit_attention.py),
each with the plain block code or its torch.compile'd form (`_compiled`, what the runtime swaps in), each row seeing
`--ctx` context frames (the voice prompt's shared frames plus a full own window), and gives the matmul work's
rate (TFLOP/s, counted by torch's FlopCounterMode on one eager solve). `--profile R N` adds the kernels of one
fused_compiled replay by summed time (bench/gpu_trace.py).

    python bench/bench_dit_solve.py --golden .gcv3 --rows 1 8 16 32 --new 56 104 --out $OUT/dit_solve.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_trace  # noqa: E402
from bench.full_model import full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms  # noqa: E402
from bench.report_file import write_report  # noqa: E402
from tts_core.accel.dit_graphs import DiTSolveGraphs, graph_regions  # noqa: E402
from tts_core.flow.dit_flow import load_dit_flow  # noqa: E402
from tts_core.flow.dit_pool import DiTContextPool, DiTRegions, DiTTables  # noqa: E402


def _inputs(pool: DiTContextPool, rows: int, ctx: int, new: int) -> tuple:
    """Index tables of `rows` streams each seeing `ctx` context frames (their own kept frames, as `main`
    set them up; the contents do not matter for the time) and rendering `new` frames without keeping them,
    with random mu, cond, spks."""
    cfg = pool.est.cfg
    per = [pool.row(slot, ctx + new, keep=False) for slot in range(rows)]
    table = pool.table(per, rows, ctx, new).to(pool.device)
    gen = torch.Generator(device=pool.device).manual_seed(0)
    mu = torch.randn(rows, cfg.mu_dim, new, device=pool.device, generator=gen).to(pool.dtype)
    cond = torch.zeros(rows, cfg.mel_dim, new, device=pool.device, dtype=pool.dtype)
    spks = torch.randn(rows, cfg.spk_dim, device=pool.device, generator=gen).to(pool.dtype)
    return table, mu, cond, spks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, required=True, help="a golden_cv3 copy (its full/ sizes)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--new", type=int, nargs="+", default=[56, 104], help="new frames a row renders")
    p.add_argument("--ctx", type=int, default=400, help="context frames a row sees (prompt + own window)")
    p.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    p.add_argument("--profile", type=int, nargs=2, metavar=("ROWS", "NEW"), default=(16, 104))
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    dev, dtype = torch.device("cuda"), {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    flow = load_dit_flow(full_model_dir(golden=args.golden, family=3), dev, dtype)
    chunk = flow.cfg.estimator.static_chunk_size
    slots = max(args.rows)
    pool = DiTContextPool(flow.decoder, slots, -(-args.ctx // chunk) * chunk, 0, dev, dtype)
    pool.add_voice("bench", 0, *(torch.empty(0),) * 3)  # no shared prompt frames: a row's context is its own
    for slot in range(slots):
        pool.start_stream(slot, "bench")
        pool.own[slot] = args.ctx  # as if `ctx` frames were spoken and kept
    keys = [(r, args.ctx, n) for r in args.rows for n in args.new]
    compiled = graph_regions(compiled=True)
    variants = {"sdpa": DiTRegions(), "fused": graph_regions(compiled=False),
                "sdpa_compiled": DiTRegions(compiled.pre, compiled.post), "fused_compiled": compiled}
    sets = {}
    for name, regions in variants.items():
        graphs = DiTSolveGraphs(pool)
        graphs.keys = sorted(keys, key=lambda k: -k[0] * k[2])
        sets[name] = graphs.capture_set(regions)
    results = []
    for rows, ctx, new in keys:
        table, mu, cond, spks = _inputs(pool, rows, ctx, new)
        tables = DiTTables(table, rows, ctx, new)
        counter = FlopCounterMode(display=False)
        with counter:
            pool.solve_tables(tables, mu, cond, spks)
        flops = counter.get_total_flops()
        row = {"rows": rows, "ctx": ctx, "new": new, "tflop": round(flops / 1e12, 3)}
        reference = sets["sdpa"][(rows, ctx, new)].replay(table, mu, cond, spks).clone()
        for name, graphs in sets.items():
            g = graphs[(rows, ctx, new)]
            row[f"{name}_diff"] = round((g.replay(table, mu, cond, spks) - reference).abs().max().item(), 4)
            ms = replay_ms(lambda: g.replay(table, mu, cond, spks), iters=5, rounds=3)
            row[f"{name}_ms"] = round(ms, 2)
            row[f"{name}_tflops"] = round(flops / ms / 1e9, 1)
        results.append(row)
        print(row, flush=True)
    report = {"device": torch.cuda.get_device_name(dev), "dtype": args.dtype, "torch": torch.__version__,
              "results": results}
    prof_rows, prof_new = args.profile
    if (prof_rows, args.ctx, prof_new) in sets["fused_compiled"]:
        table, mu, cond, spks = _inputs(pool, prof_rows, args.ctx, prof_new)
        g = sets["fused_compiled"][(prof_rows, args.ctx, prof_new)]
        g.replay(table, mu, cond, spks)
        prof = gpu_trace.record(lambda: g.replay(table, mu, cond, spks))
        found, _ = gpu_trace.kernels(prof)
        report["profile"] = {"rows": prof_rows, "new": prof_new,
                             **gpu_trace.summarize(found, top=25)["streams"]}
        for stream in report["profile"].values():
            if isinstance(stream, dict):
                for k in stream.get("top", []):
                    print(f"{k['total_ms']:8.2f} ms {k['count']:5d} x {k['mean_us']:8.1f} us  {k['name'][:100]}")
    if args.out:
        write_report(report, args.out, "dit_solve")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
