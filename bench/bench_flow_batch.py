"""Later-chunk flow cost and accuracy of the windowed trajectory path (tts_core.flow.windowed +
tts_core.accel.flow_batch) on the full-size CosyVoice2 flow (random weights).

Measures, in one process:
  accuracy (fp32, TF32 off): exact windowed vs `FlowModel.inference(streaming=True)` per call of a
           stream (first call 50+3 tokens after a 150-token prompt, hops of 50 tokens, final call);
           bounded windows vs exact; bf16 exact windowed vs the fp32 official
  cost (bf16, CUDA graphs): one later chunk (50 tokens = 100 new frames) for B = 1, 4, 16, 32
           streams at once, exact at a typical length (700 context frames) and bounded windows;
           host wall per call, device time of the graphed solve and encoder, memory per stream

    python bench/bench_flow_batch.py --golden .golden --out $OUT/flow_batch.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import build_full_model_dir  # noqa: E402
from tts_core.accel.flow_batch import BatchedFlowRenderer  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.flow.windowed import EXACT, WindowedFlowState, WindowPolicy, render_windowed  # noqa: E402

POLICIES = {"exact": EXACT, "bounded_p1_r2": WindowPolicy(prompt_chunks=1, recent_chunks=2, encoder_tokens=50),
            "bounded_p1_r4": WindowPolicy(prompt_chunks=1, recent_chunks=4, encoder_tokens=100)}
FIRST, HOP, TOTAL = 53, 50, 320  # tokens of the first call (50 + 3 lookahead), hop, utterance


def calls() -> list[tuple[int, bool]]:
    ends = list(range(FIRST, TOTAL, HOP))
    return [(n, False) for n in ends] + [(TOTAL, True)]


def wall_ms(fn, iters: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)


def replay_ms(fn, iters: int = 20, rounds: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(iters):
            fn()
        e.record()
        e.synchronize()
        per.append(s.elapsed_time(e) / iters)
    return statistics.median(per)


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.double().cpu(), b.double().cpu()
    return {"max_abs": float((a - b).abs().max()), "rel": float((a - b).norm() / b.norm()),
            "ref_max_abs": float(b.abs().max())}


def new_state(flow, voice: dict, policy: WindowPolicy) -> WindowedFlowState:
    return WindowedFlowState(flow, voice["flow_prompt_speech_token"], voice["prompt_speech_feat"],
                             voice["flow_embedding"], policy)


def accuracy(model_dir: Path, voice: dict, tokens: torch.Tensor) -> tuple[dict, list[torch.Tensor]]:
    flow = load_flow(model_dir, "cuda", torch.float32)
    pt, pf, emb = (voice[k].cuda() for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))
    official, done = [], 0
    with torch.inference_mode():
        for n, fin in calls():
            t = tokens[:, :n].cuda()
            mel, _ = flow.inference(t, torch.tensor([n]), pt, torch.tensor([pt.size(1)]), pf,
                                    torch.tensor([pf.size(1)]), emb, streaming=True, finalize=fin)
            official.append(mel[:, :, done:].cpu())
            done = mel.size(2)
    out: dict = {}
    exact_mels = None
    for name, policy in POLICIES.items():
        state = new_state(flow, voice, policy)
        mels = [render_windowed(flow, [state], [tokens[:, :n].cuda()], [fin])[0].cpu() for n, fin in calls()]
        out[f"{name}_vs_official_fp32"] = [diff(m, o) for m, o in zip(mels, official)]
        if exact_mels is None:
            exact_mels = mels
        else:
            out[f"{name}_vs_exact_fp32"] = [diff(m, e) for m, e in zip(mels, exact_mels)]
        out[f"{name}_whole_utterance_vs_official_fp32"] = diff(torch.cat(mels, 2), torch.cat(official, 2))
    del flow
    torch.cuda.empty_cache()
    return out, official


def cost(model_dir: Path, voice: dict, tokens: torch.Tensor, official: list[torch.Tensor], batches: list[int]) -> dict:
    flow = load_flow(model_dir, "cuda", torch.bfloat16)
    out: dict = {"bf16_exact_vs_official_fp32": []}
    state = new_state(flow, voice, EXACT)
    for (n, fin), ref in zip(calls(), official):
        mel = render_windowed(flow, [state], [tokens[:, :n].cuda()], [fin])[0]
        out["bf16_exact_vs_official_fp32"].append(diff(mel, ref))
    build, measured = [n for n, _ in calls()[:4]], calls()[4][0]  # context after 4 calls: 300 + 400 frames
    tok = tokens[:, :measured].cuda()
    rows = []
    for name, policy in POLICIES.items():
        tpl = new_state(flow, voice, policy)
        for n in build:
            render_windowed(flow, [tpl], [tokens[:, :n].cuda()], [False])
        plan = tpl.plan(tok, False)
        ctx, new, enc = plan.ctx_frames.numel(), plan.new_frames, plan.enc_tokens.size(1)
        renderer = BatchedFlowRenderer(flow)
        t0 = time.perf_counter()
        renderer.capture(ctx_cap=ctx, new_cap=new, enc_tokens=enc, batches=batches)
        capture_s = time.perf_counter() - t0
        # Graphed vs eager on the same inputs (bf16).
        g = renderer.render([copy.copy(tpl)], [tok], [False])[0]
        e = render_windowed(flow, [copy.copy(tpl)], [tok], [False])[0]
        eager_b1 = wall_ms(lambda: render_windowed(flow, [copy.copy(tpl)], [tok], [False]), iters=5, warmup=1)
        after = copy.copy(tpl)
        renderer.render([after], [tok], [False])
        for b in batches:
            wall = wall_ms(lambda: renderer.render([copy.copy(tpl) for _ in range(b)], [tok] * b, [False] * b))
            solve = replay_ms(renderer.solve_graphs[(b, ctx, new)].graph.replay)
            encode = replay_ms(renderer.encode_graphs[(b, enc, new, False)].graph.replay)
            rows.append({"mode": name, "batch": b, "context_frames": ctx, "new_frames": new, "encoder_tokens": enc,
                         "wall_ms_per_call": wall, "wall_ms_per_stream_chunk": wall / b,
                         "solve_graph_ms": solve, "encoder_graph_ms": encode,
                         "host_ms": wall - solve - encode,
                         "cache_bytes_per_stream": after.cache_bytes(), "cache_frames": after.cache.size(2),
                         "realtime_streams_per_gpu": round(2000.0 / (wall / b))})  # a chunk is 2 s of speech
            print(json.dumps(rows[-1]), flush=True)
        out[f"{name}_graph_vs_eager_bf16"] = diff(g, e)
        out[f"{name}_eager_b1_wall_ms"] = eager_b1
        out[f"{name}_capture_s"] = capture_s
    out["rows"] = rows
    # First call through the same path (no context: the prompt's 300 frames + 100 new), B = 1 and 4.
    first = new_state(flow, voice, EXACT)
    plan = first.plan(tokens[:, :FIRST].cuda(), False)
    renderer = BatchedFlowRenderer(flow)
    renderer.capture(ctx_cap=0, new_cap=plan.new_frames, enc_tokens=plan.enc_tokens.size(1), batches=[1, 4])
    for b in (1, 4):
        out[f"first_call_b{b}_wall_ms"] = wall_ms(lambda: renderer.render(
            [new_state(flow, voice, EXACT) for _ in range(b)], [tokens[:, :FIRST].cuda()] * b, [False] * b))
    out["exact_cache_bytes_per_frame_bf16"] = 10 * 80 * 2
    out["max_memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    out["memory_reserved_gb"] = torch.cuda.memory_reserved() / 2**30
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/cosyvoice2_full"))
    parser.add_argument("--batches", default="1,4,16,32")
    args = parser.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if not (args.model_dir / "flow.pt").is_file():
        build_full_model_dir(args.model_dir, args.golden)
    voice = next(iter(torch.load(args.model_dir / "spk2info.pt", weights_only=False).values()))
    tokens = torch.randint(0, 6561, (1, TOTAL), generator=torch.Generator().manual_seed(7))
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "schedule": {"prompt_tokens": int(voice["flow_prompt_speech_token"].size(1)), "first": FIRST, "hop": HOP,
                           "total": TOTAL, "policies": {k: vars(v) for k, v in POLICIES.items()}}}
    result["accuracy"], official = accuracy(args.model_dir, voice, tokens)
    print(json.dumps(result["accuracy"]), flush=True)
    result["cost"] = cost(args.model_dir, voice, tokens, official, [int(b) for b in args.batches.split(",")])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"{'mode':15} {'B':>3} {'ctx':>4} {'wall':>7} {'/stream':>8} {'solve':>7} {'enc':>6} {'cache KB':>9}")
    for r in result["cost"]["rows"]:
        print(f"{r['mode']:15} {r['batch']:>3} {r['context_frames']:>4} {r['wall_ms_per_call']:7.1f} "
              f"{r['wall_ms_per_stream_chunk']:8.2f} {r['solve_graph_ms']:7.1f} {r['encoder_graph_ms']:6.2f} "
              f"{r['cache_bytes_per_stream'] / 1024:9.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
