"""Per-component GPU timings of the full-size CosyVoice2 (random weights) and the accel fast paths.

Builds the full-size model dir, then measures and checks, in one process:
  LM   prefill (190 positions), decode step per batch/attend bucket (eager vs GraphedDecoder, with
       equality vs eager bf16 and error vs fp32), host RasSampler vs BatchedRasSampler
  flow first chunk (150-token prompt + 28 tokens) full recompute fp32 / bf16 eager / bf16 graphed,
       IncrementalFlow per chunk and its memory per frame, estimator scaling with batch
  HiFT first / later chunk fp32 eager and graphed, bf16 autocast SNR
and prints a table with the first-chunk latency estimate and the max real-time streams.

    python bench/bench_components.py --golden .golden --out $OUT/components.json

Needs CUDA. Imports only tts_core model code and torch (plus structlog, numpy, yaml it pulls in).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import DEFAULT_DIR, build_full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms, wall_ms  # noqa: E402
from bench.graphed_flow_call import GraphedFlowCall  # noqa: E402
from tts_core.accel.batched_sampler import BatchedRasSampler  # noqa: E402
from tts_core.accel.hift_graphs import GraphedHift  # noqa: E402
from tts_core.accel.lm_graphs import GraphedDecoder, GraphedPrefill  # noqa: E402
from tts_core.flow.incremental import IncrementalFlow  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.hift.generator import load_hift  # noqa: E402
from tts_core.llm.sampling import RasSampler, SamplingConfig  # noqa: E402
from tts_core.model_dir import load_speech_lm  # noqa: E402

R: dict = {}
BF16 = torch.bfloat16


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float(10 * torch.log10(ref.pow(2).sum() / (x.double() - ref).pow(2).sum().clamp_min(1e-30)))


def attempt(section: str, name: str, fn) -> None:
    """Run one measurement; a failure is recorded and the rest of the section still runs."""
    try:
        fn()
    except Exception:
        R.setdefault("errors", {})[f"{section}.{name}"] = traceback.format_exc()[-1500:]
        print(R["errors"][f"{section}.{name}"], file=sys.stderr, flush=True)
    save(OUT_PATH)


def save(path: Path) -> None:
    path.write_text(json.dumps(R, indent=1))


# ---- LM --------------------------------------------------------------------------------------------
def bench_lm(model_dir: Path, buckets: list[int], max_len: int, attend: list[int]) -> None:
    lm = load_speech_lm(model_dir, "cuda", BF16)
    voice = torch.load(model_dir / "spk2info.pt")["bench_voice"]
    prompt_speech = voice["llm_prompt_speech_token"][0].tolist()
    prompt_text = voice["prompt_text"][0].tolist()
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, 500, (20,), generator=gen).tolist()
    cache = lm.setup_cache(max(buckets) + 1, max_len)
    lm_input = lm.build_prefill_input(text, prompt_text, prompt_speech)
    R["lm"] = {"prefill_positions": lm_input.shape[0], "max_len": max_len}
    R["lm"]["prefill_ms_b1"] = wall_ms(lambda: lm.prefill([0], [lm_input]))
    R["lm"]["prefill_ms_b8"] = wall_ms(lambda: lm.prefill(list(range(8)), [lm_input] * 8))
    R["lm"]["decode_eager_ms"] = {}
    for b in (1, 16, 64):
        def eager(b=b):
            cache.lengths[:b] = 300
            lm.decode_step(list(range(b)), [5] * b)
        R["lm"]["decode_eager_ms"][b] = wall_ms(eager, iters=10)

    # Equality: graphed vs eager bf16 on 5 live slots of different lengths, and bf16 vs fp32.
    dec = GraphedDecoder(lm, BatchedRasSampler(SamplingConfig(), lm.speech_token_size), buckets, attend)
    live = [3, 0, 7, 2, 9]
    inputs = [lm_input[: 150 + 10 * i] for i in range(len(live))]
    lm.prefill(live, inputs)
    snap = cache.snapshot()
    toks = torch.randint(0, 6561, (4, len(live)), generator=gen)
    eager_out, graph_out = [], []
    for step in range(4):
        eager_out.append(lm.decode_step(live, toks[step].tolist()).clone())
    cache.restore(snap)
    for step in range(4):
        kv = int(cache.lengths[live].max())
        graph_out.append(dec.step(live, toks[step].tolist(), kv_len=kv).clone())
    R["lm"]["graph_vs_eager_bf16_rel"] = max(rel(g, e) for g, e in zip(graph_out, eager_out))
    lm32 = load_speech_lm(model_dir, "cuda", torch.float32)
    lm32.setup_cache(16, max_len)
    lm32.prefill(live, [x.float() for x in inputs])
    ref = [lm32.decode_step(live, toks[s].tolist()) for s in range(4)]
    R["lm"]["bf16_vs_fp32_rel_logp"] = max(rel(e, r) for e, r in zip(eager_out, ref))
    R["lm"]["bf16_vs_fp32_rel_probs"] = max(rel(e.exp(), r.exp()) for e, r in zip(eager_out, ref))
    del lm32
    torch.cuda.empty_cache()

    # Per-bucket step time at realistic KV lengths: slots filled with random K/V, lengths ~ 340.
    for buffer in cache.keys + cache.values:
        buffer.normal_()
    R["lm"]["decode_graph_ms"] = {}
    for a in dec.attend_buckets:
        start = min(a - 60, 340)
        row = {}
        for b in dec.batch_buckets:
            slots = list(range(b))
            toks_b = [7] * b

            def step(slots=slots, toks_b=toks_b, a=a):
                dec.step(slots, toks_b, kv_len=a - 1)
            cache.lengths[:b] = start
            row[b] = replay_ms(step, iters=10, rounds=5)
        R["lm"]["decode_graph_ms"][a] = row
    R["lm"]["graph_memory_mb"] = torch.cuda.memory_reserved() / 2**20

    # Sampling: host per-request RasSampler vs the batched sampler.
    cfg = SamplingConfig()
    host = RasSampler(cfg, lm.speech_token_size)
    cuda_gen = torch.Generator(device="cuda").manual_seed(0)
    logp = torch.randn(128, lm.speech_token_size + 3, device="cuda").log_softmax(-1)
    hist = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    R["lm"]["host_sampler_ms_per_row"] = wall_ms(lambda: host.sample(logp[0], hist, cuda_gen, True), iters=20)
    batched = BatchedRasSampler(cfg, lm.speech_token_size)
    history = torch.randint(0, 6561, (128, 10), device="cuda")
    allow = torch.zeros(128, dtype=torch.bool, device="cuda")
    R["lm"]["batched_sampler_ms"] = {b: wall_ms(lambda b=b: batched.sample(logp[:b], history[:b], allow[:b]).cpu(),
                                                iters=20) for b in (1, 16, 128)}
    # Distribution check of the batched sampler vs the nucleus rule on one peaked row.
    peaked = torch.full((1, lm.speech_token_size + 3), -20.0, device="cuda")
    peaked[0, :4] = torch.tensor([0.5, 0.25, 0.15, 0.10], device="cuda").log()
    draws = batched.sample(peaked.expand(8000, -1), torch.full((8000, 10), -1, device="cuda"),
                           torch.ones(8000, dtype=torch.bool, device="cuda"))
    freq = torch.bincount(draws, minlength=4)[:4].float() / 8000
    R["lm"]["batched_sampler_nucleus_freq"] = [round(float(f), 3) for f in freq]  # expect ~[0.556, 0.278, 0.167, 0]
    del dec
    torch.cuda.empty_cache()

    # Graphed prefill (one request, length buckets) vs eager.
    pre = GraphedPrefill(lm, (128, 192, 256))
    eager_logp = lm.prefill([4], [lm_input]).clone()
    R["lm"]["prefill_graph_vs_eager_rel"] = rel(pre.prefill(4, lm_input).clone(), eager_logp)
    R["lm"]["prefill_graph_ms_b1"] = wall_ms(lambda: pre.prefill(4, lm_input), iters=20)
    del pre

    # Decode + batched draw in one graph, eager modules vs torch.compile'd step.
    for name, kwargs in (("graph_sample", {}), ("compiled_graph_sample", {"compile": True})):
        t0 = time.perf_counter()
        try:
            d = GraphedDecoder(lm, batched, buckets, [max_len], **kwargs)
        except Exception:
            R.setdefault("errors", {})[f"lm.{name}"] = traceback.format_exc()[-1500:]
            continue
        R["lm"][f"{name}_capture_s"] = time.perf_counter() - t0
        cache.restore(snap)
        outs = [d.step(live, toks[i].tolist()).clone() for i in range(4)]
        R["lm"][f"{name}_vs_eager_rel"] = max(rel(o, e) for o, e in zip(outs, eager_out))
        row = {}
        for b in d.batch_buckets:
            slots = list(range(b))

            def step(slots=slots, b=b, d=d):
                d.launch(slots, [True] * b).result()
            cache.lengths[:b] = 340
            row[b] = replay_ms(step, iters=10, rounds=5)
        R["lm"][f"decode_{name}_ms"] = row
        save(OUT_PATH)
        del d
        torch.cuda.empty_cache()
    del lm
    torch.cuda.empty_cache()


# ---- flow ------------------------------------------------------------------------------------------
def bench_flow(model_dir: Path, compile_: bool) -> None:
    voice = torch.load(model_dir / "spk2info.pt")["bench_voice"]
    flow32 = load_flow(model_dir, "cuda", torch.float32)
    flow16 = load_flow(model_dir, "cuda", BF16)
    pt = voice["flow_prompt_speech_token"].cuda().long()
    pf = voice["prompt_speech_feat"].cuda()
    emb = voice["flow_embedding"].cuda()
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6561, (1, 300), generator=gen).cuda()
    first = tokens[:, :28]
    R["flow"] = {"prompt_tokens": pt.shape[1], "first_call_tokens": 28}

    def full(model, tok, dtype):
        n = torch.tensor([tok.shape[1]]); p = torch.tensor([pt.shape[1]]); f = torch.tensor([pf.shape[1]])  # noqa: E702
        return model.inference(tok, n, pt, p, pf.to(dtype), f, emb.to(dtype), streaming=True, finalize=False)[0]

    ref = full(flow32, first, torch.float32)
    R["flow"]["first_full_fp32_ms"] = wall_ms(lambda: full(flow32, first, torch.float32), iters=5)
    R["flow"]["first_full_bf16_eager_ms"] = wall_ms(lambda: full(flow16, first, BF16), iters=5)
    R["flow"]["bf16_eager_vs_fp32_rel"] = rel(full(flow16, first, BF16), ref)
    save(OUT_PATH)

    def graphs() -> None:
        graphed = GraphedFlowCall(flow16, pt.shape[1], pf.shape[1], 28)
        got = graphed.render(first, pt, pf.to(BF16), emb.to(BF16)).clone()
        R["flow"]["graph_bf16_vs_fp32_rel"] = rel(got, ref)
        R["flow"]["first_full_bf16_graph_ms"] = wall_ms(lambda: graphed.render(first, pt, pf.to(BF16), emb.to(BF16)),
                                                        iters=10)
        graphed32 = GraphedFlowCall(flow32, pt.shape[1], pf.shape[1], 28)
        R["flow"]["graph_fp32_vs_fp32_rel"] = rel(graphed32.render(first, pt, pf, emb).clone(), ref)
        R["flow"]["first_full_fp32_graph_ms"] = wall_ms(lambda: graphed32.render(first, pt, pf, emb), iters=10)
        del graphed32
        save(OUT_PATH)

    attempt("flow", "graphs", graphs)

    def incremental() -> None:
        # Incremental, bf16: per-call time and cache memory; first call checked against the full recompute.
        ends = [28 + 50 * i for i in range(6)]  # official schedule: 25 + 3 lookahead, then hops of 50
        rows = []
        for dtype, model in ((BF16, flow16), (torch.float32, flow32)):
            times, mem = [], []
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            inc = IncrementalFlow(model, pt, pf.to(dtype), emb.to(dtype))
            for i, end in enumerate(ends):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                mel = inc.render(tokens[:, :end], finalize=False)
                torch.cuda.synchronize()
                times.append((time.perf_counter() - t0) * 1e3)
                mem.append(torch.cuda.memory_allocated() - base - mel.numel() * mel.element_size())
                if i == 0:
                    R["flow"][f"incremental_first_{str(dtype)[6:]}_vs_full_fp32_rel"] = rel(mel, ref)
            frames = (pt.shape[1] + ends[-1] - 3) // 25 * 25 * 2
            rows.append({"dtype": str(dtype), "call_ms": times, "cache_bytes": mem,
                         "bytes_per_frame": mem[-1] / frames})
            del inc
        R["flow"]["incremental"] = rows
        save(OUT_PATH)

    attempt("flow", "incremental", incremental)

    def scaling() -> None:
        # Estimator batch scaling (graphed, no cache, full attention over T frames): rows of 2 (CFG).
        est = flow16.decoder.estimator
        scale = {}
        for b, t in ((2, 100), (8, 100), (32, 100), (2, 350)):
            x = torch.randn(b, 80, t, device="cuda", dtype=BF16)
            mask = torch.ones(b, 1, t, device="cuda", dtype=BF16)
            tt = torch.rand(b, device="cuda", dtype=BF16)
            spk = torch.randn(b, 80, device="cuda", dtype=BF16)
            with torch.inference_mode():
                est(x, mask, x, tt, spk, x, None)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    est(x, mask, x, tt, spk, x, None)
            scale[f"b{b}_t{t}"] = replay_ms(g.replay, iters=20, rounds=3)
            del g
        R["flow"]["estimator_graph_ms"] = scale
        save(OUT_PATH)

    attempt("flow", "scaling", scaling)

    def compiled_graph() -> None:
        if compile_:
            t0 = time.perf_counter()
            compiled = copy.deepcopy(flow16)
            compiled.decoder.estimator.forward = torch.compile(compiled.decoder.estimator.forward,
                                                               dynamic=False)
            cg = GraphedFlowCall(compiled, pt.shape[1], pf.shape[1], 28)
            R["flow"]["compile_s"] = time.perf_counter() - t0
            R["flow"]["graph_compiled_bf16_vs_fp32_rel"] = rel(cg.render(first, pt, pf.to(BF16), emb.to(BF16)).clone(), ref)
            R["flow"]["first_full_bf16_compiled_graph_ms"] = wall_ms(
                lambda: cg.render(first, pt, pf.to(BF16), emb.to(BF16)), iters=10)

    attempt("flow", "compile", compiled_graph)
    del flow16, flow32
    torch.cuda.empty_cache()


# ---- HiFT ------------------------------------------------------------------------------------------
def bench_hift(model_dir: Path) -> None:
    voc = load_hift(model_dir, "cuda", torch.float32, fold=True)
    R["hift"] = {}
    gen = torch.Generator().manual_seed(5)
    for name, frames, cache in (("first", 50, 0), ("later", 108, 3840)):
        mel = (torch.randn(1, 80, frames, generator=gen) * 2 - 6).cuda()
        src_cache = torch.randn(1, 1, max(cache, 1), generator=gen).cuda() * 0.1
        with torch.inference_mode():
            R["hift"][f"{name}_eager_fp32_ms"] = wall_ms(
                lambda: voc.inference(mel, src_cache if cache else None), iters=10)
            g = GraphedHift(voc, frames, cache)
            R["hift"][f"{name}_graph_fp32_ms"] = wall_ms(lambda: g.inference(mel, src_cache if cache else None),
                                                         iters=20)
            # Same source for both paths, so only the arithmetic differs.
            wav_g, source = g.inference(mel, src_cache if cache else None)
            wav_e = voc.decode(mel, source)
            R["hift"][f"{name}_graph_vs_eager_snr_db"] = snr_db(wav_g, wav_e)
            try:
                with torch.autocast("cuda", dtype=BF16):
                    wav_b = voc.decode(mel, source)
                R["hift"][f"{name}_autocast_bf16_snr_db"] = snr_db(wav_b.float(), wav_e)

                def bf(mel=mel, source=source):
                    with torch.autocast("cuda", dtype=BF16):
                        voc.decode(mel, source)
                R["hift"][f"{name}_autocast_bf16_decode_ms"] = wall_ms(bf, iters=10)
                R["hift"][f"{name}_eager_fp32_decode_ms"] = wall_ms(lambda: voc.decode(mel, source), iters=10)
            except Exception as exc:  # bf16 stft/istft may be unsupported; record and go on
                R["hift"][f"{name}_autocast_bf16_error"] = repr(exc)[:200]
            del g


def summary() -> str:
    lm, fl, hf = R.get("lm", {}), R.get("flow", {}), R.get("hift", {})
    lines = ["component                                   ms"]
    for k in ("prefill_ms_b1", "prefill_ms_b8"):
        if k in lm:
            lines.append(f"LM {k:<40} {lm[k]:8.2f}")
    for b, v in lm.get("decode_eager_ms", {}).items():
        lines.append(f"LM decode eager b={b:<25} {v:8.2f}")
    for a, row in lm.get("decode_graph_ms", {}).items():
        lines.append(f"LM decode graph attend={a}: " + " ".join(f"b{b}={v:.2f}" for b, v in row.items()))
    for k, v in list(fl.items()) + list(hf.items()):
        if isinstance(v, float):
            lines.append(f"{k:<43} {v:8.3f}")
    for row in fl.get("incremental", []):
        lines.append(f"incremental {row['dtype']}: calls ms " + " ".join(f"{t:.1f}" for t in row["call_ms"])
                     + f"  MB/frame {row['bytes_per_frame'] / 2**20:.2f}")
    for name in ("decode_graph_sample_ms", "decode_compiled_graph_sample_ms"):
        if name in lm:
            lines.append(f"LM {name}: " + " ".join(f"b{b}={v:.2f}" for b, v in lm[name].items()))
    steps = lm.get("decode_compiled_graph_sample_ms") or lm.get("decode_graph_sample_ms")
    flow_first = min(v for k, v in fl.items() if k.startswith("first_full_bf16") and k.endswith("graph_ms")) \
        if "first_full_bf16_graph_ms" in fl else None
    if steps and flow_first and "first_graph_fp32_ms" in hf:
        prefill = lm.get("prefill_graph_ms_b1", lm["prefill_ms_b1"])
        first = prefill + 28 * steps[1] + flow_first + hf["first_graph_fp32_ms"]
        R["estimate_first_chunk_ms"] = first
        lines.append(f"ESTIMATE first chunk @1 stream = prefill {prefill:.1f} + 28 x step+draw {steps[1]:.2f} "
                     f"+ flow {flow_first:.1f} + hift {hf['first_graph_fp32_ms']:.1f} = {first:.1f} ms")
        # Per stream and second: 25 decode rows (shared steps), 0.5 later chunks (50-token hops).
        inc_flow = statistics.median(fl["incremental"][0]["call_ms"][1:])
        est = fl.get("estimator_graph_ms", {})
        for label, flow_per_stream in (("IncrementalFlow eager, serial", inc_flow),
                                       ("projected: flow batched 16 streams/call (estimator b32 x 10 steps)",
                                        10 * est.get("b32_t100", float("nan")) / 16)):
            per_stream_s = 0.5 * (flow_per_stream + hf["later_graph_fp32_ms"]) / 1e3
            best = 0
            for b, t in steps.items():
                if 25 * t / 1e3 + int(b) * per_stream_s <= 1.0:
                    best = max(best, int(b))
            R.setdefault("estimate_max_streams", {})[label] = best
            lines.append(f"ESTIMATE max real-time streams ({label}) = {best}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global OUT_PATH
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--buckets", default="1,2,4,8,16,32,64,128")
    p.add_argument("--attend", default="256,512")
    p.add_argument("--compile", action="store_true")
    p.add_argument("--skip", default="", help="comma list of lm,flow,hift to skip")
    args = p.parse_args(argv)
    OUT_PATH = args.out
    R["device"] = torch.cuda.get_device_name()
    R["torch"] = torch.__version__
    if not (args.model_dir / "llm.pt").is_file():
        t0 = time.perf_counter()
        build_full_model_dir(args.model_dir, args.golden)
        R["build_s"] = time.perf_counter() - t0
    torch.backends.cuda.matmul.allow_tf32 = False
    skip = set(args.skip.split(","))
    buckets = [int(x) for x in args.buckets.split(",")]
    attend = [int(x) for x in args.attend.split(",")]
    for name, fn in (("lm", lambda: bench_lm(args.model_dir, buckets, max(attend), attend)),
                     ("flow", lambda: bench_flow(args.model_dir, args.compile)),
                     ("hift", lambda: bench_hift(args.model_dir))):
        if name in skip:
            continue
        t0 = time.perf_counter()
        try:
            fn()
        except Exception:
            R.setdefault("errors", {})[name] = traceback.format_exc()[-2000:]
            print(R["errors"][name], file=sys.stderr, flush=True)
        R.setdefault("section_s", {})[name] = time.perf_counter() - t0
        save(OUT_PATH)
        print(f"[{name}] done in {R['section_s'][name]:.1f}s", flush=True)
    text = summary()
    save(OUT_PATH)
    print(text)
    return 0


OUT_PATH = Path("components.json")

if __name__ == "__main__":
    sys.exit(main())
