"""A decode step beside a large flow call, with and without the flow confined to part of the GPU's
SMs (tts_core/accel/sm_partition.py), full-size model (random weights), CUDA bf16.

For each `--render-sms` value (0: no partition, both on ordinary streams, the decode at the
highest priority, as the scheduler runs them today; N: the flow on a stream of a green context of
N SMs, the decode on an ordinary stream) it times:
  decode_alone_ms / flow_alone_ms   one graph replay with the GPU otherwise idle
  decode_beside_ms                  median and p95 of decode steps, each waited for as the decode
                                    thread does, while flow solves run back to back on their stream
  decode_wall_ms                    the same steps' host wall time (launch + wait)
  flow_beside_ms                    device time per flow solve over that same stretch
  flow_launch_ms                    host time of one flow replay call (here a replay of a graph
                                    whose previous replay is still running, which waits for it)
with the flow graph captured on an ordinary stream and, for N > 0, also on the green stream
itself: a graph keeps the SMs of the stream it was captured on, not of the one it is replayed on
(H100, bench/results/sm_partition_2026-11-23_h100.json). The decode graph is the scheduler's
(compiled, fused, `--decode-batch` rows, 512 attended positions); the flow graph a batched solve of
`--flow-rows` first calls (the later lane's calls are of this size).

    python bench/bench_sm_partition.py --golden .golden --render-sms 0 100 66 --out $OUT/sm.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import DEFAULT_DIR, full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms, wall_ms  # noqa: E402
from bench.report_file import write_report  # noqa: E402
from tts_core.accel.flow_pool_graphs import PooledFlowGraphs  # noqa: E402
from tts_core.accel.lm_graphs import GraphedDecoder  # noqa: E402
from tts_core.accel.sm_partition import device_sms, green_stream  # noqa: E402
from tts_core.flow.context_pool import PoolShape  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.flow.pooled import PooledFlow  # noqa: E402
from tts_core.model_dir import load_speech_lm  # noqa: E402
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule  # noqa: E402


class FlowSolve:
    """A batched flow solve of `rows` first calls, graphed on a given stream."""

    def __init__(self, model_dir: Path, rows: int) -> None:
        speaker = next(iter(torch.load(model_dir / "spk2info.pt", weights_only=False).values()))
        flow = load_flow(model_dir, "cuda", torch.bfloat16)
        prompt = speaker["flow_prompt_speech_token"]
        self.pooled = PooledFlow(flow, PoolShape(stream_slots=rows, stream_frames=700, voice_slots=1,
                                                 voice_frames=300,
                                                 prompt_frames=prompt.size(1) * flow.cfg.token_mel_ratio),
                                 encoder_tokens=50)
        voice = self.pooled.register_voice(*(speaker[k].cuda() for k in ("flow_prompt_speech_token",
                                                                          "prompt_speech_feat", "flow_embedding")))
        first = ChunkPlanner(ChunkSchedule(), prompt.size(1)).tokens_needed()
        self.tokens = torch.randint(0, 6561, (1, first), generator=torch.Generator().manual_seed(3)).cuda()
        probe = self.pooled.open_stream(voice)
        plan = self.pooled.plan(probe, self.tokens, False)
        self.pooled.close_stream(probe)
        self.key = (rows, plan.ctx_frames, -(-plan.new_frames // 16) * 16)
        self.voice, self.rows = voice, rows

    def graph(self, stream: torch.cuda.Stream | None) -> tuple[PooledFlowGraphs, torch.cuda.CUDAGraph]:
        """Captured on `stream` (None: a fresh ordinary one); the graphs object owns its memory."""
        graphs = PooledFlowGraphs(self.pooled, stream=stream)
        graphs.capture([self.key[0]], [self.key[1]], [self.key[2]])
        streams = [self.pooled.open_stream(self.voice) for _ in range(self.rows)]
        graphs.render(streams, [self.tokens] * self.rows, [False] * self.rows)  # real rows in the graph's inputs
        for s in streams:
            self.pooled.close_stream(s)
        return graphs, graphs.solve_graphs[self.key].graph


def on(stream: torch.cuda.Stream, fn, *args, **kwargs):
    with torch.cuda.stream(stream):
        return fn(*args, **kwargs)


def beside(decode: torch.cuda.CUDAGraph, flow: torch.cuda.CUDAGraph, decode_stream, flow_stream,
           flow_alone_ms: float, seconds: float) -> dict:
    """Flow solves back to back for about `seconds` (two queued at a time, as a render lane keeps
    the GPU busy without flooding the launch queue); decode steps one at a time meanwhile, each
    waited for, as the decode thread does."""
    solves = max(4, round(seconds * 1e3 / flow_alone_ms))
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(flow_stream):
        start.record()
    ends: list[torch.cuda.Event] = []
    steps, walls, launches = [], [], []
    skip = 3  # the first steps may start before the flow has filled the GPU
    while len(ends) < solves or not ends[-1].query():
        while len(ends) < solves and sum(not e.query() for e in ends[-2:]) < 2:
            with torch.cuda.stream(flow_stream):
                t0 = time.perf_counter()
                flow.replay()
                launches.append(time.perf_counter() - t0)
                ends.append(torch.cuda.Event(enable_timing=True))
                ends[-1].record()
        d0, d1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(decode_stream):
            d0.record()
            decode.replay()
            d1.record()
        d1.synchronize()
        if skip:
            skip -= 1
        elif not ends[-1].query():
            steps.append(d0.elapsed_time(d1))
            walls.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    steps.sort()
    return {"decode_beside_ms": statistics.median(steps) if steps else None,
            "decode_beside_p95_ms": steps[int(0.95 * (len(steps) - 1))] if steps else None,
            "decode_wall_ms": statistics.median(walls) if walls else None,
            "flow_launch_ms": 1e3 * statistics.median(launches),
            "decode_steps": len(steps), "flow_beside_ms": start.elapsed_time(ends[-1]) / solves,
            "flow_solves": solves}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--render-sms", type=int, nargs="+", default=[0, 116, 100, 84])
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--flow-rows", type=int, default=16)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    started = time.perf_counter()
    full_model_dir(args.model_dir, args.golden)
    device = torch.device("cuda")
    lm = load_speech_lm(args.model_dir, device, torch.bfloat16)
    lm.setup_cache(args.decode_batch + 1, 1024)
    decoder = GraphedDecoder(lm, (args.decode_batch,), (512,))
    decode = decoder._graphs[(args.decode_batch, 512)][0]
    solve = FlowSolve(args.model_dir, args.flow_rows)
    _, flow = solve.graph(None)  # captured on an ordinary stream
    print(f"start-up {time.perf_counter() - started:.0f} s", flush=True)
    high = min(torch.cuda.Stream.priority_range())
    decode_stream = torch.cuda.Stream(device, priority=high)
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sms": device_sms(device),
                    "decode_batch": args.decode_batch, "flow_rows": args.flow_rows, "rows": []}
    decode_alone = on(decode_stream, replay_ms, decode.replay, iters=50)
    report["decode_alone_wall_ms"] = on(decode_stream, wall_ms, decode.replay, iters=20)
    # Each partition twice: the ordinary stream's graph replayed on the green stream, and a graph
    # captured on the green stream itself.
    for sms in args.render_sms:
        for captured_on in (("ordinary", "green") if sms else ("ordinary",)):
            row: dict = {"render_sms": sms, "graph_captured_on": captured_on}
            try:
                flow_stream = green_stream(sms, device) if sms else torch.cuda.Stream(device)
                graphs, graph = solve.graph(flow_stream) if captured_on == "green" else (None, flow)
                row["decode_alone_ms"] = decode_alone
                row["flow_alone_ms"] = on(flow_stream, replay_ms, graph.replay, iters=3, rounds=3)
                row.update(beside(decode, graph, decode_stream, flow_stream, row["flow_alone_ms"], args.seconds))
                del graphs
            except Exception as exc:  # report what ran; the other partitions may still work
                row["error"] = f"{type(exc).__name__}: {exc}"
            report["rows"].append(row)
            print(row, flush=True)
    write_report(report, args.out, "sm_partition", "h100")
    return 0


if __name__ == "__main__":
    sys.exit(main())
