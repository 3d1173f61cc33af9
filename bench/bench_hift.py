"""HiFT chunk cost on the GPU: captured graphs of the plain vocoder against graphs whose stages'
residual blocks are torch.compile'd (`accel.hift_graphs.compiled_mix`), full-size random weights, fp32.
A third variant captures the compiled graphs with cuDNN's benchmark mode on (does cuDNN find
better convolution kernels than its heuristics? On the H100: the same ones).

For every (rows, mel frames, cached source samples) the runtime captures (first chunks: 56 frames,
no cache; later chunks: 108 frames with 3840 cached samples) it prints and writes:
  replay ms     device time of one replay (CUDA events around back-to-back replays, median of rounds)
  kernels       kernels per replay (torch.profiler over one replay), and the kernels that take
                the most time (printed for one first chunk and a later chunk of 8 streams)
  SNR dB        compiled decode against the plain decode on the same mel and source (fp32 both)

    python bench/bench_hift.py --out $OUT/hift.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import GOLDEN, full_part_state
from bench.gpu_timing import replay_ms
from bench.report_file import write_report
from tts_core.accel.graph_capture import compiling_at_start_up
from tts_core.accel.hift_graphs import GraphedHift, compiled_mix
from tts_core.hift.generator import HiftGenerator, load_hift_checkpoint
from tts_core.model_config import load_model_yaml

FIRST = [(rows, 56, 0) for rows in (1, 2, 4, 8)]
LATER = [(rows, 108, 3840) for rows in (1, 4, 8, 16, 32)]


def full_hift(golden: Path, seed: int = 2026) -> HiftGenerator:
    """The full-size vocoder with random weights (drawn as bench/full_model.py draws them), fp32, CUDA."""
    state = full_part_state("hift", golden, seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "hift.pt"
        torch.save(state, path)
        config = load_model_yaml(golden / "full" / "cosyvoice2_full.yaml")
        return load_hift_checkpoint(config, path, "cuda", torch.float32, fold=True)


def kernels_per_replay(graph: GraphedHift, mel: torch.Tensor, cache: torch.Tensor | None) -> tuple[int, list]:
    """Kernels in one replay, and the 12 kernel names that take the most device time in it
    (name, count, total us): where the rest of a chunk's time goes."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.inference(mel, cache)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name[:90], []).append(e.device_time)
    top = sorted(((name, len(t), round(sum(t), 1)) for name, t in by_name.items()), key=lambda r: -r[2])[:12]
    return len(kernels), top


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum().clamp_min(1e-30)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="default: bench/results/hift_<date>_h100.json")
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_hift: needs CUDA", file=sys.stderr)
        return 2
    vocoder = full_hift(args.golden)
    mix = compiled_mix()
    rows_out = []
    for rows, frames, cached in FIRST + LATER:
        gen = torch.Generator(device="cuda").manual_seed(rows * 1000 + frames)
        mel = torch.randn(rows, 80, frames, device="cuda", generator=gen) * 2 - 6
        cache = torch.randn(rows, 1, cached, device="cuda", generator=gen) * 0.1 if cached else None
        row = {"rows": rows, "frames": frames, "cached_samples": cached}
        for name, variant, benchmark in (("plain", None, False), ("compiled", mix, False),
                                         ("compiled_cudnn_benchmark", mix, True)):
            t0 = time.perf_counter()
            with torch.backends.cudnn.flags(enabled=True, benchmark=benchmark, deterministic=False,
                                            allow_tf32=torch.backends.cudnn.allow_tf32):
                graph = GraphedHift(vocoder, frames, cached, rows=rows, mix=variant)
            row[f"{name}_capture_s"] = time.perf_counter() - t0
            row[f"{name}_replay_ms"] = replay_ms(lambda g=graph, m=mel, c=cache: g.inference(m, c), iters=20)
            row[f"{name}_kernels"], row[f"{name}_top_kernels"] = kernels_per_replay(graph, mel, cache)
            if (rows, cached) in ((1, 0), (8, 3840)):
                for kernel, count, us in row[f"{name}_top_kernels"]:
                    print(f"    {name[:12]:12s} {us:8.1f} us {count:4d}x {kernel}")
            del graph
        with torch.inference_mode():
            source = vocoder.draw_source(vocoder.predict_f0(mel), gen)
            plain = vocoder.decode(mel, source)
            with compiling_at_start_up():
                compiled = vocoder.decode(mel, source, mix)
        row["compiled_vs_plain_snr_db"] = snr_db(compiled, plain)
        rows_out.append(row)
        print(f"rows {rows:2d} frames {frames:3d} cache {cached:4d}: plain {row['plain_replay_ms']:7.3f} ms "
              f"({row['plain_kernels']} kernels), compiled {row['compiled_replay_ms']:7.3f} ms "
              f"({row['compiled_kernels']} kernels, capture {row['compiled_capture_s']:.1f} s), "
              f"SNR {row['compiled_vs_plain_snr_db']:.1f} dB; cuDNN benchmark: "
              f"{row['compiled_cudnn_benchmark_replay_ms']:7.3f} ms ({row['compiled_cudnn_benchmark_kernels']} kernels)",
              flush=True)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "dtype": "float32",
              "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32, "shapes": rows_out}
    write_report(report, args.out, "hift", "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
