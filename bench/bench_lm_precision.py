"""How far bf16, fp16 and FP8 weights move the full-size speech LM's token choices from float32.

For each request (random text ids, the bench voice's 20-token prompt text and 150-token prompt speech),
the float32 LM samples a continuation of `--tokens` speech tokens with the official RAS sampler.
Every variant then scores that same sequence teacher-forced, and each position's distribution is
compared with float32's (and with bf16's, the default the FP8 path would replace):

  overlap  sum over tokens of min(p, q) of the two nucleus distributions the sampler draws from
           (official top-p 0.8 / top-k 25, renormalised): the largest share of draws that can pick
           the same token, i.e. 1 - total variation. Seeded draws compared token by token would
           mostly measure the sort order of near-equal probabilities, not the precision.
  top1     the most likely token agrees
  kl       KL(reference || variant) over the whole vocabulary in nats, mean over positions

Variants: bf16, fp16 (the model in that dtype) and fp8 (the bf16 model with e4m3 decoder-layer
projections, tts_core/accel/fp8_linear.py). CPU and CUDA run the same `_scaled_mm` op with float32
accumulation, so agreement measured on either holds for both. Random weights are not trained ones:
a trained LM is more peaked (easier to agree on) but has outlier activation channels (harder for
per-token scales); the figures bound the rounding, they do not replace a listening test.

    python bench/bench_lm_precision.py --golden .golden --out bench/results/lm_precision_<date>.json
"""

from __future__ import annotations

import argparse
import copy
import platform
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.full_model import full_speech_lm  # noqa: E402
from bench.report_file import write_report  # noqa: E402
from tts_core.accel.fp8_linear import use_fp8_projections  # noqa: E402
from tts_core.llm.sampling import RasSampler, SamplingConfig  # noqa: E402
from tts_core.llm.speech_lm import SpeechTokenLM  # noqa: E402
from tts_core.model_dir import load_speech_lm  # noqa: E402

VARIANTS = ("bf16", "fp16", "fp8")


def variant(lm32: SpeechTokenLM, name: str) -> SpeechTokenLM:
    dtype = torch.float16 if name == "fp16" else torch.bfloat16
    lm = copy.deepcopy(lm32).to(dtype)
    if name == "fp8":
        use_fp8_projections(lm)
    return lm


def sample_continuation(lm: SpeechTokenLM, lm_input: torch.Tensor, tokens: int, sampler: RasSampler,
                        seed: int) -> list[int]:
    """`tokens` speech tokens drawn by the float32 LM (stop ids refused: every request is as long)."""
    lm.setup_cache(1, lm_input.shape[0] + tokens)
    gen = torch.Generator().manual_seed(seed)
    logp = lm.prefill([0], [lm_input])[0]
    history: list[int] = []
    for _ in range(tokens):
        if history:
            logp = lm.decode_step([0], [history[-1]])[0]
        history.append(sampler.sample(logp.cpu(), history, gen, allow_stop=False))
    lm.kv_cache = None
    return history


def scored(lm: SpeechTokenLM, text: list[int], prompt_text: list[int], prompt_speech: list[int],
           continuation: list[int]) -> torch.Tensor:
    """logp (N, V) float32 predicting each continuation token, teacher-forced."""
    lm_input = lm.build_prefill_input(text, prompt_text, prompt_speech)
    speech = lm.speech_embedding(torch.tensor(continuation, device=lm_input.device))
    logp = lm.teacher_forced_logp(torch.cat([lm_input, speech]))
    start = lm_input.shape[0] - 1
    return logp[start:start + len(continuation)].float().cpu()


def nucleus_probs(logp: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """(N, V) -> the distributions nucleus sampling draws from (tts_core.llm.sampling's rule), renormalised."""
    probs, order = logp.softmax(dim=-1).sort(dim=-1, descending=True, stable=True)
    taken_before = probs.cumsum(dim=-1) - probs
    keep = (taken_before < config.top_p) & (torch.arange(probs.shape[-1]) < config.top_k)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(-1, order, kept)


def compare(ref: torch.Tensor, got: torch.Tensor, config: SamplingConfig) -> dict[str, float]:
    overlap = torch.minimum(nucleus_probs(ref, config), nucleus_probs(got, config)).sum(-1)
    kl = (ref.exp() * (ref - got)).sum(-1)
    return {"positions": ref.shape[0], "overlap": float(overlap.mean()),
            "top1": float((ref.argmax(-1) == got.argmax(-1)).float().mean()), "kl": float(kl.mean())}


def pooled(rows: list[dict[str, float]]) -> dict[str, float]:
    n = sum(r["positions"] for r in rows)
    return {"positions": n, **{k: sum(r[k] * r["positions"] for r in rows) / n for k in ("overlap", "top1", "kl")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, default=REPO.parent / "shared" / "golden")
    p.add_argument("--model-dir", type=Path, help="a model directory's LM instead of full-size random weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--tokens", type=int, default=120, help="speech tokens per request")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, help="JSON path (default bench/results/lm_precision_<date>_<device>.json)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    lm32 = (load_speech_lm(args.model_dir) if args.model_dir else full_speech_lm(args.golden)).to(args.device)
    sampler = RasSampler(SamplingConfig(), lm32.speech_token_size)
    models = {name: variant(lm32, name) for name in VARIANTS}
    print(f"[{time.perf_counter() - started:5.0f} s] LM built: float32 + {', '.join(VARIANTS)}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    prompt_text = torch.randint(0, 500, (20,), generator=gen).tolist()
    prompt_speech = torch.randint(0, lm32.speech_token_size, (150,), generator=gen).tolist()
    rows: dict[str, list[dict[str, float]]] = {}
    with torch.inference_mode():
        for r in range(args.requests):
            text = torch.randint(0, 500, (int(torch.randint(8, 41, (1,), generator=gen)),), generator=gen).tolist()
            lm_input = lm32.build_prefill_input(text, prompt_text, prompt_speech)
            continuation = sample_continuation(lm32, lm_input, args.tokens, sampler, args.seed * 1000 + r)
            logp = {"fp32": scored(lm32, text, prompt_text, prompt_speech, continuation)}
            for name, lm in models.items():
                logp[name] = scored(lm, text, prompt_text, prompt_speech, continuation)
            for name in VARIANTS:
                rows.setdefault(f"{name}_vs_fp32", []).append(compare(logp["fp32"], logp[name], sampler.config))
            rows.setdefault("fp8_vs_bf16", []).append(compare(logp["bf16"], logp["fp8"], sampler.config))
            last = {k: v[-1] for k, v in rows.items()}
            print(f"[{time.perf_counter() - started:5.0f} s] request {r + 1}/{args.requests} ({len(text)} text tokens): "
                  + ", ".join(f"{k} overlap {v['overlap']:.3f} kl {v['kl']:.4f}" for k, v in last.items()), flush=True)
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    which = args.model_dir or "full-size random weights"
    report = {"device": device, "model": str(which), "requests": args.requests, "tokens": args.tokens, "seed": args.seed,
              "results": {k: pooled(v) for k, v in rows.items()}, "per_request": rows,
              "seconds": time.perf_counter() - started}
    print(f"\nspeech LM ({which}), {device}; {args.requests} requests x {args.tokens} tokens")
    print("comparison    | nucleus overlap | same top-1 | KL nats")
    for name, res in report["results"].items():
        print(f"{name:13} | {res['overlap']:15.4f} | {res['top1']:10.4f} | {res['kl']:.5f}")
    write_report(report, args.out, "lm_precision", args.device.split(":")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
