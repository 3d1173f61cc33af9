"""CosyVoice3's causal HiFT over a render call's streams: each stream rendered alone (`HiftWindows.render`, what
dit_render did before), all in batched passes (`render_many`), and batched through CUDA graphs (CUDA only).

For S streams in step on a steady schedule (first chunk, then `--hop` mel frames a chunk: the default is the
runtime's steady 100-token hop), per render call after the first chunks: wall time (the device synchronized)
and aten ops dispatched (a launch count's proxy: eagerly each is about a kernel or a view). Random mel; the
model from `--model-dir` (default the tiny golden one; a full-size one from bench/full_model.py --family 3).

    python bench/bench_cv3_vocoder_batch.py --streams 1 8 32 --out /tmp/cv3_vocoder.json
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tts_core.hift.causal import load_causal_hift
from tts_core.hift.causal_window import HiftWindows, decode_windows

GOLDEN_TINY = Path(os.environ.get("COSYVOICE3_GOLDEN_DIR", Path(__file__).resolve().parents[1].parent / "shared"
                                  / "golden_cv3")) / "cosyvoice3_tiny"  # where the tests find it


class OpCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def run(hift, streams: int, ends: list[int], how: str, graphs, device: torch.device, seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    mels = [(torch.randn(1, hift.cfg.in_channels, ends[-1] + 8, generator=gen) * 2).to(device) for _ in range(streams)]
    windows = HiftWindows(hift, streams, ends[-1] + 8, device)
    emitted, seconds, ops = [0] * streams, [], []
    for end in ends:
        calls = [(i, mels[i][:, :, :end], emitted[i], False) for i in range(streams)]
        _sync(device)
        started, count = time.perf_counter(), OpCount()
        with count:
            if how == "alone":
                out = [windows.render(*call) for call in calls]
            else:
                out = windows.render_many(calls, graphs=graphs if how == "graphs" else None)
        _sync(device)
        seconds.append(time.perf_counter() - started)
        ops.append(count.ops)
        for i, (wav, known) in enumerate(out):
            windows.commit(i, known)
            emitted[i] += wav.size(1)
    steady = slice(2, None)  # past the first chunk and the first slid window
    return {"call_ms": [round(1e3 * s, 2) for s in seconds[steady]], "ops_per_call": ops[steady][-1]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=GOLDEN_TINY)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--first", type=int, default=50, help="mel frames of the first chunk")
    parser.add_argument("--hop", type=int, default=200, help="mel frames a chunk after the first")
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # the CI machine's cores are shared
    hift = load_causal_hift(args.model_dir, device)
    ends = [args.first + k * args.hop for k in range(args.calls)]
    graphs = None
    hows = ["alone", "batched"]
    if device.type == "cuda":
        from tts_core.accel.causal_hift_graphs import CausalHiftGraphs
        graphs = CausalHiftGraphs(hift, device)
        graphs.capture(rows=sorted({1, *args.streams}), frames=decode_windows(hift, ends))
        hows.append("graphs")
    report = {"model_dir": str(args.model_dir), "device": str(device), "ends": ends,
              "windows": decode_windows(hift, ends), "results": {}}
    for streams in args.streams:
        for how in hows:
            result = run(hift, streams, ends, how, graphs, device)
            report["results"][f"{how}/{streams}"] = result
            print(f"{how:>8} x{streams:<4} ops/call {result['ops_per_call']:>7}  ms/call {result['call_ms']}")
    if graphs is not None:
        report["eager_calls"] = graphs.eager_calls
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
