"""Kernels per Euler step of one pooled flow call: a device-free proxy for the flow's launch cost.

At batch 1 the flow is bound by kernel launches, not arithmetic (docs/PERF_NOTES.md: ~50 ms of a
first chunk for 10 steps). This counts, for a first-chunk call of the full-size flow (random
weights) after the bench voice's prompt:

  eager     aten ops dispatched per step, views excluded (each is about one CUDA kernel; the
            captured graph replays exactly these)
  compiled  calls per step with compile_flow: the eager ops outside the compiled regions (resnets
            and transformer blocks) plus, per region call, the calls in the code inductor generates
            for it (fused kernels and extern calls: matmul, convolution, attention). On CPU inductor fuses into
            C++ loops, on CUDA into Triton kernels; the grouping is close but not identical, so read
            it as an estimate until a GPU run confirms it.

    python bench/count_flow_ops.py --golden .golden [--compiled] --out bench/results/flow_ops_<date>.json

Runs on CPU (the default) in a few seconds eager; compiling the full-size regions takes a minute there.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.full_model import full_model_dir  # noqa: E402
from bench.report_file import write_report  # noqa: E402
from tts_core.accel.flow_pool_graphs import compiled_estimator  # noqa: E402
from tts_core.flow.context_pool import PooledStepContext, PoolShape  # noqa: E402
from tts_core.flow.encoder_window import encode_grouped  # noqa: E402
from tts_core.flow.estimator import Regions  # noqa: E402
from tts_core.flow.model import load_flow  # noqa: E402
from tts_core.flow.pooled import (  # noqa: E402
    PooledFlow,
    VoicePrefix,
    additive_mask,
    attention_mask,
    call_index,
)

FIRST_TOKENS = 28  # the default schedule's first call: 25 tokens + 3 lookahead
ALLOCATIONS = {"empty", "empty_like", "empty_strided", "detach", "lift_fresh"}


class DispatchCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not func.is_view and name not in ALLOCATIONS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


def step_inputs(pooled: PooledFlow, voice: VoicePrefix, tokens: torch.Tensor) -> tuple:
    """The estimator arguments of the first Euler step of one first-chunk call (as pooled_solve makes them)."""
    plan = pooled.plan(pooled.open_stream(voice), tokens, False)
    mu = pooled.stack_mu(encode_grouped(pooled.model, [plan]), 1, plan.new_frames)
    index = call_index(pooled.pool, pooled.table([plan.row]), plan.ctx_frames, plan.new_frames)
    est = pooled.model.decoder.estimator
    attn = additive_mask(attention_mask(index, est.cfg.static_chunk_size, est.cfg.num_decoding_left_chunks), mu.dtype)
    x = torch.randn_like(mu)
    mu_in = torch.cat([mu, torch.zeros_like(mu)])
    spks = pooled.pool.spks[:1]
    return (torch.cat([x, x]), None, mu_in, None, torch.cat([spks, torch.zeros_like(spks)]), torch.zeros_like(mu_in),
            attn, PooledStepContext(pooled.pool, index.at_step(pooled.pool, 0)), pooled.steps[0].time_biases)


def count_generated_calls(sources: list[str]) -> dict[str, int]:
    """Calls in the generated wrapper's `call` function: fused kernels and extern ops."""
    fused = extern = 0
    for src in sources:
        body = src.split("def call(", 1)[-1].split("\ndef ", 1)[0]
        # CPU: cpp_fused_<ops>(...); CUDA: triton_<kind>_fused_<ops>_<n>.run(...)
        fused += len(re.findall(r"^\s+(?:cpp_fused_\w+|triton_\w+\.run)\(", body, flags=re.MULTILINE))
        extern += len(re.findall(r"^\s+(?:\w+ = )?(?:extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(", body,
                                 flags=re.MULTILINE))
    return {"fused_kernels": fused, "extern_calls": extern, "total": fused + extern}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--golden", type=Path, default=REPO.parent / "shared" / "golden")
    p.add_argument("--model-dir", type=Path, help="default: full-size random weights built into /tmp")
    p.add_argument("--device", default="cpu")
    p.add_argument("--compiled", action="store_true", help="also count the torch.compile'd step's kernels")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        model_dir = full_model_dir(golden=args.golden)
    dtype = torch.float32 if args.device == "cpu" else torch.bfloat16
    flow = load_flow(model_dir, args.device, dtype)
    speaker = next(iter(torch.load(model_dir / "spk2info.pt", weights_only=False).values()))
    prompt_frames = speaker["prompt_speech_feat"].size(1)
    pooled = PooledFlow(flow, PoolShape(stream_slots=1, stream_frames=400, voice_slots=1,
                                        voice_frames=-(-prompt_frames // 50) * 50, prompt_frames=prompt_frames))
    voice = pooled.register_voice(*(speaker[k].to(args.device) for k in (
        "flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding")))
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, FIRST_TOKENS), generator=torch.Generator().manual_seed(0))
    inputs = step_inputs(pooled, voice, tokens.to(args.device))
    est = flow.decoder.estimator
    report: dict = {"device": args.device, "model_dir": str(model_dir), "first_tokens": FIRST_TOKENS,
                    "new_frames": inputs[0].size(2), "context_frames": inputs[6].size(-2)}
    # Per call of a compiled region, in call order: (its key, eager ops). A region compiles at its
    # first call with a new key, so the compiled sources come in the order the keys first appear.
    # The key is what dynamo specializes on here: the weights' shapes (input width) and, for a
    # resnet, whether its input is a transposed view (a transformer block's or, channels-last, a
    # convolution's output) or not.
    regions: list[tuple[str, int]] = []

    def counted(kind: str, run):
        def call(module, h, *rest):
            before = sum(counter.ops.values())
            out = run(module, h, *rest)
            key = f"block{h.size(2)}" if kind == "block" else f"resnet{h.size(1)}{'' if h.is_contiguous() else 't'}"
            regions.append((key, sum(counter.ops.values()) - before))
            return out
        return call

    counting = Regions(block=counted("block", lambda m, h, mask, ctx: m(h, mask, ctx)),
                       resnet=counted("resnet", lambda m, h, bias, a, b: m(h, None, bias, a, b)))
    # With --compiled, the estimator as compile_flow prepares it (stacked projections, channels-last
    # convolution weights) for the eager count too: a resnet's input layout is part of its key.
    compiled = compiled_estimator(est) if args.compiled else None
    with torch.inference_mode():
        est(*inputs)
        with DispatchCounter() as counter:
            est(*inputs)
        with DispatchCounter() as counter:
            est(*inputs, regions=counting)
    report["eager_ops_per_step"] = sum(counter.ops.values())
    report["eager_ops_outside_regions"] = report["eager_ops_per_step"] - sum(n for _, n in regions)
    report["region_calls_per_step"] = dict(collections.Counter(key for key, _ in regions))
    report["eager_ops_by_name"] = dict(counter.ops.most_common())
    print(f"eager: {report['eager_ops_per_step']} dispatched ops per Euler step "
          f"({', '.join(f'{k} {v}' for k, v in counter.ops.most_common(8))}, ...)", flush=True)
    if args.compiled:
        from torch._inductor.utils import run_and_get_code

        started = time.perf_counter()
        with torch.inference_mode():
            _, sources = run_and_get_code(compiled, *inputs)
        report["compile_s"] = time.perf_counter() - started
        keys = list(dict.fromkeys(key for key, _ in regions))
        if len(sources) != len(keys):
            raise SystemExit(f"expected one compiled graph per region shape {keys}, got {len(sources)}")
        per_key = {key: count_generated_calls([src]) for key, src in zip(keys, sources)}
        report["compiled_calls_per_region"] = per_key
        c = {name: sum(per_key[key][name] for key, _ in regions) for name in ("fused_kernels", "extern_calls")}
        c["eager_outside_regions"] = report["eager_ops_outside_regions"]
        c["total"] = sum(c.values())
        report["compiled_calls_per_step"] = c
        print(f"compiled: {c['total']} calls per Euler step ({c['fused_kernels']} fused kernels, "
              f"{c['extern_calls']} extern calls in {len(regions)} compiled region calls, "
              f"{c['eager_outside_regions']} eager ops outside them; {len(sources)} compiled graphs: "
              f"{report['compiled_calls_per_region']}); compile {report['compile_s']:.0f} s", flush=True)
    write_report(report, args.out, "flow_ops", args.device.split(":")[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
