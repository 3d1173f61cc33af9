"""One batched decode step of the full-size speech LM on CUDA bf16: eager vs graphed vs compiled+graphed.

Builds the full-size model (random weights, bench/full_model.py), fills the KV cache with random
keys/values, gives each live slot a random length in [kv_min, kv_max) and times, per batch size:

  eager            SpeechTokenLM.decode_step, host wall time per step (launch-bound)
  graph            GraphedDecoder (every graph draws its tokens too), separate q/k/v and gate/up
                   matmuls (fuse=False)
  graph_fused      GraphedDecoder with fused q/k/v and gate/up weights
  compiled_gather  GraphedDecoder(compile=True, slot_attention=False), fused: attention over rows
                   gathered from the cache (SDPA with a length mask)
  compiled_fused   GraphedDecoder(compile=True), fused, rotary + cache write + attention by slot in
                   one kernel (tts_core/accel/decode_attention.py); construction time = compile + capture
  compiled_fp8     compiled_fused with FP8 decoder-layer projections (tts_core/accel/fp8_linear.py);
                   its rel is FP8 rounding, checked against a looser bound (agreement of the token
                   distribution: bench/bench_lm_precision.py). `--variants` picks which run.

Each graphed variant's first step is checked against the eager step from the same cache state:
rel = ||logp - logp_eager|| / ||logp_eager|| must be under bf16 tolerance and NaN-free. Times are
device-event medians of back-to-back replays (`replay`) and host wall per synchronized step with
host-list inputs, as a scheduler calls it (`wall`). Every variant is also compared with a float32
eager step from the same cache (`rel_fp32`: what bf16 itself costs), and SDPA's enable_gqa kernel is
timed against query heads folded per key head (b128, 512 columns) since qwen2.py picks one of them.

    python bench/bench_decode.py --golden .golden --out $OUT/decode.json

Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import DEFAULT_DIR, full_model_dir  # noqa: E402
from bench.gpu_timing import replay_ms, wall_ms  # noqa: E402
from tts_core.accel.batched_sampler import BatchedRasSampler  # noqa: E402
from tts_core.accel.fp8_linear import use_fp8_projections  # noqa: E402
from tts_core.accel.lm_graphs import GraphedDecoder  # noqa: E402
from tts_core.llm.sampling import SamplingConfig  # noqa: E402
from tts_core.model_dir import load_speech_lm  # noqa: E402

REL_TOL = 2e-2  # bf16 logits through 24 layers: graph-vs-eager reorderings land near 1e-3
FP8_REL_TOL = 0.3  # e4m3 weights and activations through 24 layers: a sanity bound (NaN, lost scale)
R: dict = {"rows": {}, "errors": {}}
REFERENCE: dict[int, torch.Tensor] = {}  # float32 logp per batch size, same cache state


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


class Case:
    """Live slots, their lengths and tokens for one batch size, over a shared random cache."""

    def __init__(self, lm, batch: int, kv_min: int, kv_max: int, gen: torch.Generator) -> None:
        cache = lm.kv_cache
        usable = cache.max_batch - 1  # the last slot is GraphedDecoder's scratch row
        self.slots = torch.randperm(usable, generator=gen)[:batch]
        self.tokens = torch.randint(0, lm.speech_token_size, (batch,), generator=gen)
        self.lengths = torch.randint(kv_min, kv_max, (batch,), generator=gen)
        self.kv_len = int(self.lengths.max())
        self.cache = cache
        self.base = cache.lengths.clone()
        self.base[self.slots.to(self.base.device)] = self.lengths.to(self.base.device)
        self.slots_dev = self.slots.cuda()
        self.tokens_dev = self.tokens.cuda()

    def rewind(self) -> None:
        self.cache.lengths.copy_(self.base)


def time_variant(name: str, dec: GraphedDecoder | None, lm, cases: dict[int, Case], eager: dict[int, torch.Tensor],
                 snap, tol: float = REL_TOL) -> None:
    cache = lm.kv_cache
    for b, case in cases.items():
        row = R["rows"].setdefault(str(b), {})
        cache.restore(snap)
        case.rewind()
        if dec is None:
            out = lm.decode_step(case.slots_dev, case.tokens_dev, case.kv_len + 1).clone()
            step = lambda c=case: lm.decode_step(c.slots.tolist(), c.tokens.tolist(), c.kv_len + 1)  # noqa: E731
            row[f"{name}_wall_ms"] = wall_ms(step, iters=5, rewind=case.rewind)
            if b in eager:  # a later eager variant (fused weights) is checked against the first
                row[f"{name}_rel"] = rel(out, eager[b])
            else:
                eager[b] = out
            continue
        out = dec.step(case.slots_dev, case.tokens_dev, kv_len=case.kv_len).clone()
        error = rel(out, eager[b])
        row[f"{name}_rel"] = error
        row[f"{name}_ok"] = bool(torch.isfinite(out).all()) and error < tol
        if b in REFERENCE:
            row[f"{name}_rel_fp32"] = rel(out, REFERENCE[b])
        fast = lambda c=case: dec.step(c.slots_dev, c.tokens_dev, kv_len=c.kv_len)  # noqa: E731
        host = lambda c=case: dec.step(c.slots.tolist(), c.tokens.tolist(), kv_len=c.kv_len).cpu()  # noqa: E731
        row[f"{name}_replay_ms"] = replay_ms(fast, rewind=case.rewind)
        row[f"{name}_wall_ms"] = wall_ms(host, iters=20, rewind=case.rewind)


def fp32_reference(model_dir: Path, lm, cases: dict[int, Case], snap, eager: dict[int, torch.Tensor],
                   reference: dict[int, torch.Tensor]) -> None:
    """The same steps in float32 from the same (bf16-valued) cache: what bf16 itself costs in error."""
    lm32 = load_speech_lm(model_dir, "cuda", torch.float32)
    cache32 = lm32.setup_cache(lm.kv_cache.max_batch, lm.kv_cache.max_len)
    keys, values, _ = snap
    for b, case in cases.items():
        for dst, src in zip(cache32.keys + cache32.values, keys + values):
            dst.copy_(src)
        cache32.lengths.copy_(case.base)
        reference[b] = lm32.decode_step(case.slots_dev, case.tokens_dev, case.kv_len + 1).clone()
        R["rows"][str(b)]["eager_rel_fp32"] = rel(eager[b], reference[b])
    del lm32, cache32
    torch.cuda.empty_cache()


def attention_kernels(R_attn: dict) -> None:
    """SDPA with enable_gqa vs query heads folded per key head, b128 x 14/2 heads x 512 columns, bf16."""
    b, heads, kv, length, dim = 128, 14, 2, 512, 64
    q = torch.randn(b, heads, 1, dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, kv, length, dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    mask = torch.arange(length, device="cuda")[None, None, None] <= torch.randint(200, 512, (b, 1, 1, 1), device="cuda")
    gqa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)  # noqa: E731
    folded = lambda: F.scaled_dot_product_attention(q.reshape(b, kv, heads // kv, dim), k, v,  # noqa: E731
                                                    attn_mask=mask.expand(b, 1, heads // kv, length))
    R_attn["rel"] = rel(folded().reshape(b, heads, 1, dim), gqa())
    for name, fn in (("enable_gqa", gqa), ("folded", folded)):
        R_attn[f"{name}_ms"] = replay_ms(fn, iters=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, required=True)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,16,64,128")
    p.add_argument("--kv-min", type=int, default=200)
    p.add_argument("--kv-max", type=int, default=500)
    p.add_argument("--attend", type=int, default=512)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--variants", default="graph,graph_fused,compiled_gather,compiled_fused,compiled_fp8",
                   help="graphed variants to run, comma-separated (eager always runs)")
    args = p.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]
    R.update(device=torch.cuda.get_device_name(), torch=torch.__version__, batches=batches,
             kv=[args.kv_min, args.kv_max], attend=args.attend)

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(R, indent=1))

    def attempt(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            R["errors"][name] = traceback.format_exc()[-2000:]
            print(R["errors"][name], file=sys.stderr, flush=True)
        save()
        print(f"[{time.strftime('%X')}] {name} done", flush=True)

    full_model_dir(args.model_dir, args.golden)
    lm = load_speech_lm(args.model_dir, "cuda", torch.bfloat16)
    cache = lm.setup_cache(max(batches) + 1, args.max_len)
    gen = torch.Generator().manual_seed(7)
    for t in cache.keys + cache.values:
        t.normal_()  # never time on zeros
    snap = cache.snapshot()
    cases = {b: Case(lm, b, args.kv_min, args.kv_max, gen) for b in batches}
    eager: dict[int, torch.Tensor] = {}
    attend = (args.attend,)

    attempt("attention_kernels", lambda: attention_kernels(R.setdefault("attention", {})))
    attempt("eager", lambda: time_variant("eager", None, lm, cases, eager, snap))
    attempt("fp32_reference", lambda: fp32_reference(args.model_dir, lm, cases, snap, eager, REFERENCE))

    def graphed(name: str, tol: float = REL_TOL, **kwargs) -> None:
        sampler = BatchedRasSampler(SamplingConfig(), lm.speech_token_size)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dec = GraphedDecoder(lm, sampler, batches, attend, **kwargs)
        R[f"{name}_startup_s"] = time.perf_counter() - t0
        R[f"{name}_memory_mb"] = torch.cuda.memory_reserved() / 2**20
        save()
        time_variant(name, dec, lm, cases, eager, snap, tol=tol)
        del dec
        lm.kv_cache.decode_attention = None  # the eager variants keep the generic attention
        torch.cuda.empty_cache()

    wanted = set(args.variants.split(","))
    if "graph" in wanted:
        attempt("graph", lambda: graphed("graph", compile=False, fuse=False))
    lm.fuse_projections()
    attempt("eager_fused", lambda: time_variant("eager_fused", None, lm, cases, eager, snap))
    if "graph_fused" in wanted:
        attempt("graph_fused", lambda: graphed("graph_fused", compile=False))
    if not args.no_compile:
        if "compiled_gather" in wanted:
            attempt("compiled_gather", lambda: graphed("compiled_gather", compile=True, slot_attention=False))
        if "compiled_fused" in wanted:
            attempt("compiled_fused", lambda: graphed("compiled_fused", compile=True))
        if "compiled_fp8" in wanted:  # last: the conversion stays on the model
            def fp8() -> None:
                R["fp8_summary"] = vars(use_fp8_projections(lm))
                graphed("compiled_fp8", compile=True, tol=FP8_REL_TOL)
            attempt("compiled_fp8", fp8)

    names = ["eager", "graph", "graph_fused", "compiled_gather", "compiled_fused", "compiled_fp8"]
    print(f"\ndecode step, {R['device']}, bf16, kv {args.kv_min}-{args.kv_max}, attend {args.attend}: "
          "replay ms (wall ms) [rel vs eager]")
    print("batch | " + " | ".join(names))
    for b in batches:
        row = R["rows"].get(str(b), {})
        cells = [f"{row.get('eager_wall_ms', float('nan')):.2f} wall"]
        for n in names[1:]:
            cells.append(f"{row.get(f'{n}_replay_ms', float('nan')):.3f} ({row.get(f'{n}_wall_ms', float('nan')):.2f})"
                         f" [{row.get(f'{n}_rel', float('nan')):.1e}{'' if row.get(f'{n}_ok', False) else ' FAIL'}]")
        print(f"{b:5d} | " + " | ".join(cells))
    for n in names[1:]:
        if f"{n}_startup_s" in R:
            print(f"{n}: start-up {R[n + '_startup_s']:.1f} s, reserved {R[n + '_memory_mb']:.0f} MB")
    print("eager with fused weights, rel vs eager:",
          {b: R["rows"].get(str(b), {}).get("eager_fused_rel") for b in batches})
    print("rel vs fp32:", {b: {k: f"{v:.1e}" for k, v in R["rows"].get(str(b), {}).items() if k.endswith("rel_fp32")}
                           for b in batches})
    print("attention b128:", R.get("attention"))
    print("errors:", list(R["errors"]))
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
