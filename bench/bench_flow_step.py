"""The first-chunk flow solve of a new call (the 1-stream latency path), graphed: the eager estimator
step against the torch.compile'd one (`compile_flow`), full-size flow (random weights), CUDA bf16.

For each of `--rows` streams' first calls after the bench voice's 150-token prompt (one graph
bucket: the voice's shared context, the first call's new frames), per variant: start-up (compile +
capture), device time of one solve replay, and the mel's difference from the eager-step graph.

    python bench/bench_flow_step.py --golden .golden --out $OUT/flow_step.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import DEFAULT_DIR, full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms  # noqa: E402
from bench.report_file import write_report  # noqa: E402
from tts_core.accel.flow_pool_graphs import PooledFlowGraphs, compiled_estimator  # noqa: E402
from tts_core.flow.context_pool import PoolShape  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.flow.pooled import PooledFlow  # noqa: E402
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4])
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    full_model_dir(args.model_dir, args.golden)
    speaker = next(iter(torch.load(args.model_dir / "spk2info.pt", weights_only=False).values()))
    flow = load_flow(args.model_dir, "cuda", torch.bfloat16)
    prompt = speaker["flow_prompt_speech_token"]
    pooled = PooledFlow(flow, PoolShape(stream_slots=max(args.rows), stream_frames=700, voice_slots=1,
                                        voice_frames=300, prompt_frames=prompt.size(1) * flow.cfg.token_mel_ratio),
                        encoder_tokens=50)
    voice = pooled.register_voice(*(speaker[k].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat",
                                                                 "flow_embedding")))
    first = ChunkPlanner(ChunkSchedule(), prompt.size(1)).tokens_needed()
    tokens = torch.randint(0, 6561, (1, first), generator=torch.Generator().manual_seed(3)).cuda()
    probe = pooled.open_stream(voice)
    plan = pooled.plan(probe, tokens, False)
    pooled.close_stream(probe)
    new_cap = -(-plan.new_frames // 16) * 16
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "first_call_tokens": first,
                    "context_frames": plan.ctx_frames, "new_frames": plan.new_frames, "variants": {}}
    print(f"first call: {first} tokens, context {plan.ctx_frames} frames, {plan.new_frames} new", flush=True)
    mels = {}
    for name in ("eager_step", "compiled_step"):
        t0 = time.perf_counter()
        estimator = compiled_estimator(flow.decoder.estimator) if name == "compiled_step" else None
        graphs = PooledFlowGraphs(pooled, estimator)
        graphs.capture(args.rows, [plan.ctx_frames], [new_cap])
        row: dict = {"startup_s": time.perf_counter() - t0}
        for rows in args.rows:
            streams = [pooled.open_stream(voice) for _ in range(rows)]
            mels[(name, rows)] = torch.cat(graphs.render(streams, [tokens] * rows, [False] * rows))
            solve = graphs.solve_graphs[(rows, plan.ctx_frames, new_cap)]
            row[f"solve_ms_rows_{rows}"] = replay_ms(solve.graph.replay, iters=20, rounds=5)
            for s in streams:
                pooled.close_stream(s)
        row["eager_calls"] = graphs.eager_calls
        report["variants"][name] = row
        print(name, row, flush=True)
        del graphs
        torch.cuda.empty_cache()
    for rows in args.rows:
        a, b = mels[("eager_step", rows)].double(), mels[("compiled_step", rows)].double()
        report[f"compiled_vs_eager_rel_rows_{rows}"] = float((a - b).norm() / a.norm())
    print({k: v for k, v in report.items() if k.startswith("compiled_vs")})
    write_report(report, args.out, "flow_step", "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
