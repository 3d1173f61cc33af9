"""CosyVoice3 in float32, bfloat16 and float16 through our runtime: golden parity per stage, and streaming
synthesis on full-size random weights with no NaN/Inf, no silence and no click at a stream's edges.

Per dtype:
(a) the tiny golden model (../shared/golden_cv3/cosyvoice3_tiny): each stage's max abs difference from the
    official float32 outputs (bench/cv3_golden_parity.py), within the limits the CosyVoice2 GPU check uses
    (tests/tts_core/test_golden_dtypes_cuda.py) and float32's own; then its streams, as in (b) (`tiny_streams`).
(b) a model directory (default: full-size random weights, bench/full_model.py --family 3, built once in
    /tmp/cosyvoice3_full_bench) loaded by `CosyVoice2Pipeline.load` as the engine loads it (on CUDA with its
    graphs: LM decode and prefill captured, the DiT flow and causal HiFT eager) (`full_streams`).
Streams: for each text (English, Chinese, Chinese with the `sichuan` dialect instruct), one stream alone, its
speech-token count forced (random weights rarely say stop), unpaced (`JobOptions.paced=False`: later chunks
are not held back to a listener's pace; a first chunk never is):
- no NaN/Inf in the LM's logits (a teacher-forced forward over the prefill and the tokens the stream drew:
  same weights and dtype as the graphed step, not its own logits), in any chunk's mel (each render call's
  output) or in the audio (the render lane also fails a job whose audio is not finite: `error`);
- not silent: the RMS over the whole stream at or over SILENCE_FLOOR_DBFS (-40 dBFS, an RMS of 0.01 of full
  scale: bench/audible.py's audible level), as 16-bit PCM;
- clicks (bench/edge_click.py; the measure of tests/engine_service/api/test_http_tts_cv3.py, 0.056 on the tiny
  model on CPU): the largest jump in the first and last 20 ms against the largest in the rest, each side
  (`click_start`, `click_end`) and their larger (`click_ratio`, the README's figure), and `edge_step`, the
  first and last samples against silence (the cut itself). Checked: `edge_step` everywhere and, on the tiny
  model, `click_start`, at most CLICK_RATIO_MAX. The windows are figures elsewhere: random weights speak to
  their last (forced) token, so the last 20 ms hold loud content whatever the dtype (tiny model, float32,
  CPU: `click_end` 0.07-0.94 over 16 streams, the step under 0.04), and full-size random weights may make
  full-scale noise from the first sample (tiny-shaped weights drawn as full_model.py draws them, CPU: start
  0.42-0.45, end 1.0, step ~0.1);
- the first-chunk time (submit -> first chunk handed over), a side figure: one stream, after a warm-up.
Exit status 1 if any check fails; the JSON is written either way (after each dtype too).

On CUDA the decode step's torch.compile is off by default (`torch._dynamo.config.disable`): the engine is
ready on graphs of the eager modules and swaps the compiled decode in later (compiled_graphs_complete); a cold
compile costs ~1 min per dtype. `--compiled` waits for the compiled graphs instead (the serving steady state).

    # GPU host, through scripts/gpu_bench.sh with .golden_cv3 (a copy of ../shared/golden_cv3) carried; the full
    # model is built first (~15-60 s), then ~2 min on an H100; writes $OUT/cv3_dtypes_cuda_h100.json (named
    # for the GPU); --texts 2 or --dtypes bfloat16 float16 for a shorter run
    bash scripts/gpu_bench.sh timeout 420 python3 bench/bench_cv3_dtypes.py --golden .golden_cv3 --out "$OUT"
    # CPU dry run (tiny model for both parts, seconds)
    python bench/bench_cv3_dtypes.py --device cpu --dtypes float32 bfloat16 float16 --threads 1 \\
        --model-dir ../shared/golden_cv3/cosyvoice3_tiny --tokens 60

Writes bench/results/cv3_dtypes_<device>.json (e.g. cv3_dtypes_cuda_h100.json, cv3_dtypes_cpu.json) unless --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from tts_core.accel import resolve_dtype

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audible import AUDIBLE_DBFS  # noqa: E402
from cv3_golden_parity import golden_parity  # noqa: E402
from edge_click import edge_jumps  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DTYPES = ("float32", "bfloat16", "float16")  # --dtype choices, resolved by tts_core.accel.resolve_dtype
SAMPLE_RATE = 24_000
SILENCE_FLOOR_DBFS = AUDIBLE_DBFS
CLICK_RATIO_MAX = 0.5  # as tests/engine_service/api/test_http_tts_cv3.py
# (name, text, dialect): one stream each
TEXTS = (("en", "Hello, thank you for calling. Your order has shipped and arrives tomorrow morning.", None),
         ("zh", "您好，欢迎致电客服中心，请问有什么可以帮您？", None),
         ("zh_sichuan", "您好，欢迎致电客服中心，请问有什么可以帮您？", "sichuan"))
# Golden stage -> dtype -> the most max abs difference allowed: the CosyVoice2 GPU limits
# (tests/tts_core/test_golden_dtypes_cuda.py; the DiT estimator as that flow estimator); float32: rounding only.
LIMITS = {"lm_logp": {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1},
          "dit_estimator_stream": {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.1},
          "flow_mel_nonstream": {"float32": 1e-2, "bfloat16": 1.5, "float16": 0.25},
          "runtime_stream_mel": {"float32": 1e-2, "bfloat16": 1.5, "float16": 0.25}}
RMS_RATIO_BOUNDS = (0.8, 1.25)  # the vocoder's loudness on this dtype's mel over the golden's


def default_golden() -> Path:
    return Path(os.environ.get("COSYVOICE3_GOLDEN_DIR", REPO.parent / "shared" / "golden_cv3"))


def device_slug(device: torch.device) -> str:
    """`cuda_h100` from "NVIDIA H100 80GB HBM3", `cpu` on the host."""
    if device.type != "cuda":
        return "cpu"
    model = re.search(r"\b([A-Z]+\d{2,4})\b", torch.cuda.get_device_name(device))
    return f"cuda_{model.group(1).lower()}" if model else "cuda"


def _part_checks(part: str, result: dict, dtype: str) -> list[str]:
    """What failed in one part, one line each (empty: passed)."""
    if part == "golden_tiny":
        return golden_checks(result, dtype)
    return [f for name, r in result["texts"].items() for f in stream_checks(name, r, part == "tiny_streams")]


def golden_checks(parity: dict, dtype: str) -> list[str]:
    """What failed in part (a)'s stages, one line each."""
    failed = [f"golden {stage} not finite" for stage, ok in parity["finite"].items() if not ok]
    failed += [f"golden {stage} {parity[stage]} > {limit[dtype]}" for stage, limit in LIMITS.items()
               if parity[stage] > limit[dtype]]
    for key in ("hift_rms_ratio", "runtime_stream_rms_ratio"):
        if not RMS_RATIO_BOUNDS[0] <= parity[key] <= RMS_RATIO_BOUNDS[1]:
            failed.append(f"golden {key} {parity[key]} outside {RMS_RATIO_BOUNDS}")
    return failed


class MelWatch:
    """Wraps the renderer's `render` (the render lanes call it) to see each chunk's mel: finite, largest value."""

    def __init__(self, renderer) -> None:
        self.chunks: list[tuple[bool, float]] = []
        inner = renderer.render

        def render(items, lane="later"):
            out = inner(items, lane)
            for chunk in out:
                if chunk.mel.numel():
                    mel = chunk.mel.float()
                    self.chunks.append((bool(torch.isfinite(mel).all()), mel.abs().max().item()))
            return out

        renderer.render = render


@torch.inference_mode()
def lm_logits_check(pipeline, job) -> dict:
    """A teacher-forced forward over the stream's prefill and drawn tokens: are the logits finite."""
    lm = pipeline.scheduler.lm
    prompt_text, prompt_speech = job.lm_prompt()
    lm_input = lm.build_prefill_input(job.segments[-1], prompt_text, prompt_speech)
    drawn = torch.tensor(job.tokens, dtype=torch.long, device=lm_input.device)
    hidden = lm.teacher_forced_hidden(torch.cat([lm_input, lm.speech_embedding(drawn)]))
    logits = lm.llm_decoder(hidden[lm_input.shape[0] - 1:]).float()
    return {"finite": bool(torch.isfinite(logits).all()), "max_abs": round(logits.abs().max().item(), 3)}


def one_stream(pipeline, watch: MelWatch, voice: str, text: str, dialect: str | None, tokens: int,
               seed: int) -> dict:
    from speech_audio.g711 import float_to_pcm16
    from tts_core.runtime import CollectingSink, JobOptions

    watch.chunks.clear()
    sink = CollectingSink()
    options = JobOptions(seed=seed, min_tokens=tokens, max_tokens=tokens, paced=False,
                         instruct_tokens=pipeline.instruct_tokens(None, dialect))
    job = pipeline.synthesize(text, voice, sink, options)
    out: dict = {"segments": len(job.segments)}
    try:
        audio = np.concatenate(sink.wait(300))
    except Exception as exc:  # noqa: BLE001 - a failed stream (non-finite audio ends the job) is the finding
        out.update(error=f"{type(exc).__name__}: {exc}", mel_finite=all(ok for ok, _ in watch.chunks))
        return out
    t = job.timings
    limit = np.float32(pipeline.scheduler.hift.cfg.audio_limit)
    pcm = float_to_pcm16(audio).astype(np.float64) / 32768
    rms = float(np.sqrt(np.mean(pcm ** 2))) if pcm.size else 0.0
    out.update({
        "audio_s": round(audio.size / SAMPLE_RATE, 3), "chunks": len(sink.chunks),
        "first_chunk_ms": round(t.since_submit(t.first_chunk) * 1e3, 1),
        "audio_finite": bool(np.isfinite(audio).all()), "peak": round(float(np.abs(audio).max()), 4),
        # the share of samples at the vocoder's clamp (its yaml's audio_limit): saturated noise, not speech
        "clipped_share": round(float(np.mean(np.abs(audio) >= limit)), 4),
        "rms_dbfs": round(20 * np.log10(rms), 2) if rms > 0 else None,
        **_clicks(pcm),
        "mel_finite": all(ok for ok, _ in watch.chunks), "mel_max_abs": round(max(m for _, m in watch.chunks), 3),
        "lm_logits": lm_logits_check(pipeline, job),
    })
    return out


def _clicks(pcm: np.ndarray) -> dict:
    if pcm.size <= 4 * SAMPLE_RATE // 50:  # no "rest" beside two 20 ms edges
        return {"click_start": None, "click_end": None, "click_ratio": None, "edge_step": None}
    j = edge_jumps(pcm, SAMPLE_RATE)
    return {"click_start": round(j.start, 4), "click_end": round(j.end, 4),
            "click_ratio": round(max(j.start, j.end), 4), "edge_step": round(j.step, 4)}


def stream_checks(name: str, r: dict, windows: bool) -> list[str]:
    """What failed for one stream, one line each; `windows`: the 20 ms start window is checked too."""
    if "error" in r:
        return [f"{name}: {r['error']}"]
    failed = [f"{name}: {what} not finite" for what, ok in (("audio", r["audio_finite"]), ("mel", r["mel_finite"]),
                                                             ("LM logits", r["lm_logits"]["finite"])) if not ok]
    if r["rms_dbfs"] is None or r["rms_dbfs"] < SILENCE_FLOOR_DBFS:
        failed.append(f"{name}: silent (RMS {r['rms_dbfs']} dBFS < {SILENCE_FLOOR_DBFS})")
    for key in ("click_start", "edge_step") if windows else ("edge_step",):
        if r[key] is None or r[key] > CLICK_RATIO_MAX:
            failed.append(f"{name}: {key} {r[key]} > {CLICK_RATIO_MAX}")
    return failed


def streams(model_dir: Path, device: torch.device, dtype: str, tokens: int, args) -> dict:
    from tts_core.runtime import CosyVoice2Pipeline, SchedulerSettings
    from tts_core.streaming.chunk_schedule import ChunkSchedule

    graphs = device.type == "cuda" and not args.no_graphs
    started = time.perf_counter()
    # normalize=False: the texts need no normalising, and the lent GPU hosts may lack its FST data.
    # The engine's CosyVoice3 schedule (engines/cosyvoice2/settings.py max_hop_for: hops 25, 50, 100).
    pipeline = CosyVoice2Pipeline.load(model_dir, device, resolve_dtype(dtype), max_batch=1, max_len=args.max_len,
                                       schedule=ChunkSchedule(hop_tokens=25, max_hop_tokens=100),
                                       fast=SchedulerSettings(graphs=graphs), normalize=False)
    report: dict = {"graphs": graphs, "compiled": bool(graphs and args.compiled)}
    try:
        if graphs:
            pipeline.scheduler.wait_compiled()  # quick with compile off: the eager graphs captured again
        report["load_s"] = round(time.perf_counter() - started, 2)
        names = pipeline.voices.names()
        voice = "bench_voice" if "bench_voice" in names else names[0]
        report["voice"] = voice
        report["warmup_s"] = round(pipeline.warmup(voice), 3)
        watch = MelWatch(pipeline.scheduler.renderer)
        report["texts"] = {name: one_stream(pipeline, watch, voice, text, dialect, tokens, seed)
                           for seed, (name, text, dialect) in enumerate(TEXTS[:args.texts])}
        report["graphs_state"] = pipeline.scheduler.graphs_state  # "failed": the tts-compile thread failed
    finally:
        pipeline.close()
    firsts = [r["first_chunk_ms"] for r in report["texts"].values() if "first_chunk_ms" in r]
    report["first_chunk_ms_median"] = statistics.median(firsts) if firsts else None
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["float32", "bfloat16", "float16"])
    p.add_argument("--golden", type=Path, default=None,
                   help="the CosyVoice3 golden set (default $COSYVOICE3_GOLDEN_DIR or ../shared/golden_cv3)")
    p.add_argument("--model-dir", type=Path, default=None,
                   help="part (b)'s model (default: full-size random weights built from <golden>/full)")
    p.add_argument("--build-dir", type=Path, default=None,
                   help="where the full-size model is built (default /tmp/cosyvoice3_full_bench; kept if whole)")
    p.add_argument("--tokens", type=int, default=150, help="speech tokens per full-size stream (forced; 150 = 6 s)")
    p.add_argument("--tiny-tokens", type=int, default=60, help="speech tokens per tiny-model stream")
    p.add_argument("--texts", type=int, default=len(TEXTS), help=f"how many of the {len(TEXTS)} texts")
    p.add_argument("--max-len", type=int, default=1024, help="KV-cache positions per slot")
    p.add_argument("--no-graphs", action="store_true", help="CUDA: no graphs (default: the engine's graphs)")
    p.add_argument("--compiled", action="store_true", help="CUDA: wait for the compiled decode graphs")
    p.add_argument("--skip-golden", action="store_true", help="part (b) only")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: leave as is)")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON file, or a folder to write cv3_dtypes_<device>.json into (default bench/results/)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not args.compiled:
        from torch._dynamo import config as dynamo_config

        dynamo_config.disable = True  # torch.compile leaves the function as it is
    golden = args.golden or default_golden()
    model_dir = args.model_dir
    started = time.perf_counter()
    if model_dir is None:
        from full_model import full_model_dir

        model_dir = full_model_dir(args.build_dir, golden=golden, family=3)
    name = f"cv3_dtypes_{device_slug(device)}.json"
    out = args.out or REPO / "bench" / "results" / name
    if out.is_dir():  # e.g. the device host's $OUT: the file is named for the GPU that ran it
        out = out / name
    report: dict = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}",
        "torch": torch.__version__,
        "command": " ".join(["python3", "bench/bench_cv3_dtypes.py", *(argv or sys.argv[1:])]),
        "golden": str(golden), "model_dir": str(model_dir),
        "tokens_per_stream": {"tiny": args.tiny_tokens, "full": args.tokens},
        "silence_floor_dbfs": SILENCE_FLOOR_DBFS, "click_ratio_max": CLICK_RATIO_MAX, "golden_limits": LIMITS,
        "model_build_s": round(time.perf_counter() - started, 2), "dtypes": {}, "failed": []}
    tiny = golden / "cosyvoice3_tiny"
    for dtype in args.dtypes:
        t0 = time.perf_counter()
        parts = [] if args.skip_golden else [
            ("golden_tiny", lambda: golden_parity(golden, device, resolve_dtype(dtype))),
            ("tiny_streams", lambda: streams(tiny, device, dtype, args.tiny_tokens, args))]
        parts.append(("full_streams", lambda: streams(model_dir, device, dtype, args.tokens, args)))
        entry: dict = {}
        for part, run in parts:
            try:  # a part that fails (a load, a warm-up ending in NaN) is a finding: the others still run
                entry[part] = run()
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                entry[part] = {"error": f"{type(exc).__name__}: {exc}"}
                report["failed"].append(f"{dtype} {part}: {entry[part]['error']}")
                continue
            report["failed"] += [f"{dtype} {part} {f}" for f in _part_checks(part, entry[part], dtype)]
        entry["seconds"] = round(time.perf_counter() - t0, 1)
        report["dtypes"][dtype] = entry
        _print(dtype, entry)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        if device.type == "cuda":
            gc.collect()  # the closed pipeline's graphs and weights, before the next dtype's load
            torch.cuda.empty_cache()
    report["passed"] = not report["failed"]
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(("PASSED" if report["passed"] else "FAILED:\n  " + "\n  ".join(report["failed"])) + f"\nwrote {out}")
    return 0 if report["passed"] else 1


def _print(dtype: str, entry: dict) -> None:
    for part, result in entry.items():
        if isinstance(result, dict) and "error" in result:
            print(f"{dtype} {part}: ERROR {result['error']}", flush=True)
        elif part == "golden_tiny":
            print(f"{dtype} golden: " + ", ".join(f"{k} {v}" for k, v in result.items() if isinstance(v, float)),
                  flush=True)
        elif part.endswith("_streams"):
            _print_streams(f"{dtype} {part}", result)


def _print_streams(title: str, s: dict) -> None:
    print(f"{title} (load {s['load_s']} s, first chunk median {s['first_chunk_ms_median']} ms, "
          f"graphs {s['graphs']}" + (f" ({s.get('graphs_state')})" if s["graphs"] else "") + "):")
    for name, r in s["texts"].items():
        if "error" in r:
            print(f"  {name}: ERROR {r['error']}")
            continue
        print(f"  {name}: {r['audio_s']} s in {r['chunks']} chunks, first {r['first_chunk_ms']} ms, "
              f"RMS {r['rms_dbfs']} dBFS, peak {r['peak']} ({r['clipped_share']} clipped), "
              f"click start/end {r['click_start']}/{r['click_end']} step {r['edge_step']}, "
              f"finite audio/mel/logits {r['audio_finite']}/{r['mel_finite']}/{r['lm_logits']['finite']} "
              f"(mel max {r['mel_max_abs']}, logit max {r['lm_logits']['max_abs']})", flush=True)


if __name__ == "__main__":
    sys.exit(main())
