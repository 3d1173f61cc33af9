"""Baseline of one streamed CosyVoice2 request: where the first chunk's latency goes, and per-chunk cost.

Loads a model directory (default: full-size random weights built with bench/full_model.py into
/tmp, reused if already there), warms up, then streams ONE request with a forced speech-token count
(random weights rarely say stop, and a fixed count makes runs comparable), and prints:

- per chunk: tokens, LM time since the previous chunk, flow time, HiFT time, audio seconds, and the
  wall time from submit to hand-off;
- the first chunk's latency split: frontend, prefill, decode (+ sampling), flow, HiFT, hand-off,
  and what is left (scheduling and queueing).

Results go to bench/results/gpu_baseline_<device>_<dtype>.json (or --out). The output audio is
checked for NaN/inf (exit 1). Also runs on CPU with the tiny golden model in a few seconds:

    python bench/gpu_baseline.py                                   # cuda, bf16, full size
    python bench/gpu_baseline.py --model-dir ../shared/golden/cosyvoice2_tiny --device cpu --dtype float32
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from tts_core.accel import resolve_dtype

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices, resolved by tts_core.accel.resolve_dtype
TEXT = "Thank you for calling. Your call is important to us, please stay on the line."


def _model_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    sys.path.insert(0, str(REPO / "bench"))
    from full_model import full_model_dir

    return full_model_dir()


def run(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", help="model directory (default: full-size random weights in /tmp)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=DTYPES, default=None,
                        help="default bfloat16 on CUDA, float32 on CPU")
    parser.add_argument("--voice", default="bench_voice", help="voice name (falls back to the only/first voice)")
    parser.add_argument("--tokens", type=int, default=150, help="speech tokens to generate (forced)")
    parser.add_argument("--text", default=TEXT)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    parser.add_argument("--out", help="JSON path (default bench/results/gpu_baseline_<device>_<dtype>.json)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")

    from tts_core.runtime import CollectingSink, CosyVoice2Pipeline, JobOptions

    model_dir = _model_dir(args.model_dir)
    started = time.perf_counter()
    pipeline = CosyVoice2Pipeline.load(model_dir, device=args.device, dtype=resolve_dtype(dtype_name), max_batch=1)
    load_s = time.perf_counter() - started
    try:
        names = pipeline.voices.names()
        voice = args.voice if args.voice in names else names[0]
        warmup_s = pipeline.warmup(voice)
        sink = CollectingSink()
        job = pipeline.synthesize(args.text, voice, sink,
                                  JobOptions(seed=args.seed, min_tokens=args.tokens, max_tokens=args.tokens),
                                  call_id="gpu_baseline")
        audio = np.concatenate(sink.wait(600))
    finally:
        pipeline.close()

    t = job.timings
    chunks = [dict(vars(c)) for c in t.chunks]
    first = t.chunks[0]
    first_s = t.since_submit(t.first_chunk)
    split = {"frontend_s": t.frontend_s, "prefill_s": t.prefill_s, "decode_s": first.lm_s, "flow_s": first.flow_s,
             "hift_s": first.hift_s, "handoff_s": first.handoff_s}
    split["other_s"] = first_s - sum(split.values())
    total_s = t.since_submit(t.finished)
    result = {
        "model_dir": str(model_dir), "device": args.device, "dtype": dtype_name, "voice": voice,
        "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor(),
        "torch": torch.__version__, "tokens": args.tokens, "load_s": load_s, "warmup_s": warmup_s,
        "first_chunk_s": first_s, "first_chunk_split": split, "total_s": total_s,
        "audio_s": len(audio) / 24_000, "rtf": total_s / (len(audio) / 24_000), "chunks": chunks,
        "finite": bool(np.isfinite(audio).all()), "peak": float(np.abs(audio).max()),
    }
    _print(result)
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"gpu_baseline_{args.device}_{dtype_name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    return result


def _print(r: dict) -> None:
    print(f"\n{r['device']} {r['dtype']} ({r['gpu']}), {r['tokens']} tokens, load {r['load_s']:.2f} s, "
          f"warm-up {r['warmup_s']:.2f} s")
    print(f"{'chunk':>5} {'tokens':>6} {'lm_ms':>8} {'flow_ms':>8} {'hift_ms':>8} {'audio_s':>8} {'wall_s':>8}")
    for c in r["chunks"]:
        print(f"{c['index']:>5} {c['tokens']:>6} {c['lm_s'] * 1e3:>8.1f} {c['flow_s'] * 1e3:>8.1f} "
              f"{c['hift_s'] * 1e3:>8.1f} {c['audio_s']:>8.2f} {c['at_s']:>8.3f}")
    print(f"first chunk after {r['first_chunk_s'] * 1e3:.1f} ms: "
          + ", ".join(f"{k[:-2]} {v * 1e3:.1f}" for k, v in r["first_chunk_split"].items()))
    print(f"total {r['total_s']:.2f} s for {r['audio_s']:.2f} s of audio (RTF {r['rtf']:.3f}); "
          f"finite={r['finite']} peak={r['peak']:.3f}")


def main(argv: list[str] | None = None) -> int:
    result = run(argv)
    if not result["finite"]:
        print("FAIL: the audio holds NaN or inf", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
