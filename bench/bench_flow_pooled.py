"""Flow cost and accuracy of the pooled path (tts_core.flow.pooled + accel.flow_pool_graphs) on the
full-size CosyVoice2 flow (random weights), one process:

  accuracy: pooled vs `FlowModel.inference(streaming=True)` (the official full re-run) for every call
            of a 320-token utterance after a 150-token prompt (first call 50+3 tokens, hops of 50,
            final), fp32 (TF32 off) and bf16 (graphs) against the fp32 official
  cost (bf16, CUDA graphs; --compile: of the torch.compile'd estimator step): one later chunk (50 tokens = 100 new frames) for B streams at once, at
            several context lengths (own frames already spoken); first calls; device time of the
            graphed solve and encoder, host wall per call, pool memory, capture time
  --hops 50,100: the later chunk's cost also at other hops (tokens a chunk; CosyVoice2's default 50), after the
          same spoken context, per second of speech as well: a larger hop re-projects the context less often
  --cost-only: no accuracy runs (shorter, for a lease's last minutes)
  --int8: the context pool keeps int8 codes (PoolShape.int8, `flow_context_int8`): the accuracy also of
          fp32 with int8 against the official, and the bf16 part (accuracy and cost) with int8

    python bench/bench_flow_pooled.py --golden .golden --out $OUT/flow_pooled.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import gpu_trace  # noqa: E402
from bench.full_model import DEFAULT_DIR, full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms, wall_ms  # noqa: E402
from tts_core.accel.flow_pool_graphs import PooledFlowGraphs, compiled_estimator  # noqa: E402
from tts_core.flow.context_pool import PoolShape  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.flow.pooled import PooledFlow  # noqa: E402

FIRST, HOP, TOTAL = 53, 50, 320  # tokens of the first call (50 + 3 lookahead), hop, utterance
CTX_OWN = (100, 300, 500)  # own frames already spoken before the measured chunk


def calls() -> list[tuple[int, bool]]:
    return [(n, False) for n in range(FIRST, TOTAL, HOP)] + [(TOTAL, True)]


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().cpu(), b.double().cpu()
    return {"max_abs": float((a - b).abs().max()), "rel": float((a - b).norm() / b.norm())}


def voice_args(voice: dict) -> tuple[torch.Tensor, ...]:
    return tuple(voice[k].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))


def official_calls(flow, voice: dict, tokens: torch.Tensor) -> list[torch.Tensor]:
    pt, pf, emb = voice_args(voice)
    out, done = [], 0
    with torch.inference_mode():
        for n, fin in calls():
            mel, _ = flow.inference(tokens[:, :n].cuda(), torch.tensor([n]), pt, torch.tensor([pt.size(1)]), pf,
                                    torch.tensor([pf.size(1)]), emb, streaming=True, finalize=fin)
            out.append(mel[:, :, done:].cpu())
            done = mel.size(2)
    return out


def stream_calls(render, pooled: PooledFlow, voice, tokens: torch.Tensor) -> list[torch.Tensor]:
    stream = pooled.open_stream(voice)
    mels = [render([stream], [tokens[:, :n].cuda()], [fin])[0].cpu() for n, fin in calls()]
    pooled.close_stream(stream)
    return mels


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--batches", default="1,4,16,32,64")
    parser.add_argument("--compile", action="store_true",
                        help="captured solves call the torch.compile'd estimator step (compile_flow)")
    parser.add_argument("--profile", action="store_true",
                        help="the kernels of one solve replay at the largest batch, by summed time")
    parser.add_argument("--profile-own", type=int, default=CTX_OWN[-1], choices=(0, *CTX_OWN),
                        help="own frames spoken before the profiled call (0: a first call); default the most")
    parser.add_argument("--int8", action="store_true", help="the pool keeps int8 codes (flow_context_int8)")
    parser.add_argument("--hops", default=str(HOP), help="later-chunk hops to time, tokens, comma-separated")
    parser.add_argument("--cost-only", action="store_true", help="skip the accuracy runs")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    hops = [int(h) for h in args.hops.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    full_model_dir(args.model_dir, args.golden)
    voice_raw = next(iter(torch.load(args.model_dir / "spk2info.pt", weights_only=False).values()))
    # Past TOTAL only for hops longer than HOP (the accuracy calls end at TOTAL).
    tokens = torch.randint(0, 6561, (1, TOTAL + max(hops)), generator=torch.Generator().manual_seed(7))
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "schedule": {"prompt_tokens": int(voice_raw["flow_prompt_speech_token"].size(1)), "first": FIRST,
                                 "hop": HOP, "total": TOTAL}}

    # Accuracy, fp32: the pooled path against the official full re-run.
    result["int8"] = args.int8
    if not args.cost_only:
        flow32 = load_flow(args.model_dir, "cuda", torch.float32)
        official = official_calls(flow32, voice_raw, tokens)
        for int8 in (False, True) if args.int8 else (False,):
            pooled32 = PooledFlow(flow32, PoolShape(stream_slots=2, stream_frames=700, voice_slots=1, voice_frames=300,
                                                    prompt_frames=300, int8=int8))
            v32 = pooled32.register_voice(*voice_args(voice_raw))
            mels = stream_calls(pooled32.render, pooled32, v32, tokens)
            key = "fp32_int8_pooled_vs_official" if int8 else "fp32_pooled_vs_official"
            result[key] = [diff(m, o) for m, o in zip(mels, official)]
            print(f"{key} per call:", result[key], flush=True)
        del pooled32, flow32
        torch.cuda.empty_cache()

    # bf16 with graphs.
    torch.backends.cuda.matmul.allow_tf32 = True
    flow = load_flow(args.model_dir, "cuda", torch.bfloat16)
    slots = max(batches) + 1
    # 700 own frames (the runtime's 14 s) hold the default hop's calls unslid; a longer hop's last call needs more.
    own_frames = 700 + -(-2 * (max(hops) - HOP) // 50) * 50
    shape = PoolShape(stream_slots=slots, stream_frames=own_frames, voice_slots=1, voice_frames=300, prompt_frames=300,
                      int8=args.int8)
    pooled = PooledFlow(flow, shape)
    voice = pooled.register_voice(*voice_args(voice_raw))
    result["pool_gb"] = pooled.pool.nbytes() / 2**30
    result["pool_mb_per_stream_slot"] = pooled.pool.nbytes() / slots / 2**20
    graphs = PooledFlowGraphs(pooled, compiled_estimator(flow.decoder.estimator) if args.compile else None)
    result["compiled"] = args.compile
    # Context = the voice's shared frames + the prompt's last chunk (50) + what was spoken.
    ctx_caps = [voice.prefix_frames] + [voice.prefix_frames + 50 + c for c in CTX_OWN]
    # New frames of a later call: 2 x hop + the lookahead's, in a bucket of 8 more; 160 for first calls.
    result["capture_s"] = graphs.capture(batches, ctx_caps, sorted({2 * h + 12 for h in hops} | {160}))
    if not args.cost_only:
        t0 = time.perf_counter()
        result["bf16_eager_vs_official_fp32"] = [diff(m, o) for m, o in
                                                 zip(stream_calls(pooled.render, pooled, voice, tokens), official)]
        result["bf16_graphs_vs_official_fp32"] = [diff(m, o) for m, o in
                                                  zip(stream_calls(graphs.render, pooled, voice, tokens), official)]
        print("bf16 graphs vs official fp32:", result["bf16_graphs_vs_official_fp32"], flush=True)
        result["accuracy_bf16_s"] = time.perf_counter() - t0

    rows = []
    for hop, own in [(HOP, 0)] + [(h, own) for h in hops for own in CTX_OWN]:
        # Streams that have spoken `own` frames after the prompt (on the default hop's grid): time their next
        # chunk of `hop` tokens (own 0: the first call).
        spoken = FIRST + own // 2 - HOP
        first_tokens = FIRST if own == 0 else spoken + hop
        for b in batches:
            streams = [pooled.open_stream(voice) for _ in range(b)]
            for n in range(FIRST, spoken + 1, HOP) if own else ():  # bring the streams to `own` spoken frames
                graphs.render(streams, [tokens[:, :n].cuda()] * b, [False] * b)
            saved = [(s.committed, s.emitted) for s in streams]
            tok = tokens[:, :first_tokens].cuda()

            def one_call() -> None:
                for s, (c, e) in zip(streams, saved):
                    s.committed, s.emitted, s.finished = c, e, False
                graphs.render(streams, [tok] * b, [False] * b)

            wall = wall_ms(one_call)
            streams[0].committed, streams[0].emitted, streams[0].finished = *saved[0], False
            plan = pooled.plan(streams[0], tok, False)
            fits = [k for k in graphs.solve_graphs if k[0] >= b and k[1] >= plan.ctx_frames and k[2] >= plan.new_frames]
            key = min(fits, key=lambda k: (k[0] * (k[1] + k[2]), k[0])) if fits else None
            def replay_solve(key=key) -> None:  # the bucket's solve: its graphs in order (one part unless split)
                for graph in graphs.solve_graphs[key].graphs:
                    graph.replay()

            solve = replay_ms(replay_solve, iters=20, rounds=3) if key else float("nan")
            if args.profile and key and b == max(batches) and own == args.profile_own and hop == HOP:
                found, _ = gpu_trace.kernels(gpu_trace.record(replay_solve))
                busiest = max(gpu_trace.summarize(found, top=20)["streams"].values(), key=lambda s: s["kernel_ms"])
                result["profile"] = {"batch": b, "own_frames": own, "bucket": list(key), **busiest}
                for k in busiest["top"]:
                    print(f"{k['total_ms']:8.2f} ms {k['count']:5d} x {k['mean_us']:8.1f} us  {k['name'][:100]}")
            for s in streams:
                pooled.close_stream(s)
            # Speech the call adds: the first call's tokens less the lookahead, else the hop.
            speech_s = ((FIRST - flow.cfg.pre_lookahead_len) if own == 0 else hop) * flow.cfg.token_mel_ratio / 50
            row = {"hop": hop, "own_frames": own, "batch": b, "context_frames": plan.ctx_frames,
                   "new_frames": plan.new_frames, "bucket": list(key) if key else None, "wall_ms_per_call": wall,
                   "wall_ms_per_stream_chunk": wall / b, "solve_graph_ms": solve, "solve_ms_per_stream_chunk": solve / b,
                   "solve_ms_per_stream_speech_s": solve / b / speech_s, "eager_calls": graphs.eager_calls}
            rows.append(row)
            print(json.dumps(row), flush=True)
    result["rows"] = rows
    result["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"pool {result['pool_gb']:.2f} GB ({result['pool_mb_per_stream_slot']:.0f} MB/slot), "
          f"capture {result['capture_s']:.1f} s")
    print(f"{'hop':>4} {'own':>4} {'B':>3} {'ctx':>4} {'new':>4} {'wall':>7} {'/stream':>8} {'solve':>7} {'/stream':>8}"
          f" {'/speech s':>9}")
    for r in rows:
        print(f"{r['hop']:>4} {r['own_frames']:>4} {r['batch']:>3} {r['context_frames']:>4} {r['new_frames']:>4} "
              f"{r['wall_ms_per_call']:7.1f} {r['wall_ms_per_stream_chunk']:8.2f} {r['solve_graph_ms']:7.1f} "
              f"{r['solve_ms_per_stream_chunk']:8.2f} {r['solve_ms_per_stream_speech_s']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
