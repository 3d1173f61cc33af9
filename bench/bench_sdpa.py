"""The flow's attention by scaled_dot_product_attention backend, on the shapes a pooled flow call has
(H100 question: cuDNN's attention was the largest kernel of a first chunk's Euler step, ~10 us a
block alone, 14 under load; docs/PERF_NOTES.md).

Queries (2B, 8 heads, new frames, 64), keys/values (2B, 8, context + new, 64) in bf16, and the
additive chunk mask the pooled flow builds (tts_core/flow/pooled.additive_mask: (2B, 1, N, K) with
16-aligned rows). Each backend's call is captured in a CUDA graph and replayed back-to-back
(device time per call, no launch overhead), and its output compared with the math backend's.

    python bench/bench_sdpa.py --out $OUT/sdpa.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_timing import replay_ms
from bench.report_file import write_report
from tts_core.accel.graph_capture import capture_graph
from tts_core.flow.pooled import additive_mask

# (name, streams B, context frames, new frames)
SHAPES = [("first chunk", 1, 250, 112), ("first chunks x4", 4, 250, 112),
          ("later chunks x8", 8, 650, 112), ("later chunks x32", 32, 650, 112)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "math": SDPBackend.MATH}


def chunk_bias(rows: int, new: int, context: int, chunk: int = 50) -> torch.Tensor:
    """The pooled flow's additive chunk mask for rows whose new frames follow `context` committed ones."""
    q = torch.arange(context, context + new, device="cuda").view(1, -1, 1)
    k = torch.arange(context + new, device="cuda").view(1, 1, -1)
    ok = (k // chunk <= q // chunk).expand(rows, -1, -1).unsqueeze(1)
    return additive_mask(ok, torch.bfloat16)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default: bench/results/sdpa_<date>_h100.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_sdpa: needs CUDA", file=sys.stderr)
        return 2
    rows_out = []
    for name, streams, context, new in SHAPES:
        rows = 2 * streams
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(rows, 8, new, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        k, v = (torch.randn(rows, 8, context + new, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
                for _ in range(2))
        bias = chunk_bias(rows, new, context)
        row: dict = {"shape": name, "rows": rows, "context": context, "new": new}
        ref = None
        for backend, kind in BACKENDS.items():
            try:
                with sdpa_kernel([kind]):
                    graph = torch.cuda.CUDAGraph()
                    out = capture_graph(graph, lambda q=q, k=k, v=v, m=bias: F.scaled_dot_product_attention(
                        q, k, v, attn_mask=m), warmup=2)
                row[f"{backend}_us"] = replay_ms(graph.replay, iters=100) * 1e3
                ref = out.float() if ref is None else ref
                row[f"{backend}_max_abs_vs_cudnn"] = float((out.float() - ref).abs().max())
            except RuntimeError as exc:  # a backend that does not take this shape or mask
                row[f"{backend}_error"] = str(exc).splitlines()[0][:200]
        rows_out.append(row)
        print(f"{name:18s} " + "  ".join(f"{b} {row[f'{b}_us']:6.1f} us" if f"{b}_us" in row
                                         else f"{b} n/a ({row[f'{b}_error'][:60]})" for b in BACKENDS), flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": rows_out}
    write_report(report, args.out, "sdpa", "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
