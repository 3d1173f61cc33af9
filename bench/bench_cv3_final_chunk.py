"""CosyVoice3's final chunk: the official full-attention re-render against the chunk-masked final chunk
from the DiT context pool, and what the pool saves over today's re-render of every chunk (CPU).

  difference (tiny golden model, CPU fp32): the final chunk's mel, chunk-masked from the pool against
      the official (golden `stream_calls[-1]["mel_new"]`, = `mel_nonstream`'s tail), and the same for
      random token sequences of several lengths (the official = `flow.inference(streaming=False)`).
  cost: FLOPs (torch.utils.flop_counter) of the full-size flow (shapes from ../shared/golden_cv3/full,
      built on the meta device: nothing allocated) by utterance length, on the runtime's default
      schedule and a 150-token (6 s) prompt: per segment, the pooled chunks (the voice's shared prompt
      frames not counted: rendered once per voice) with the chunk-masked final chunk, the official final
      call (full re-render), and the re-render of every chunk that dit_render.py did before the pool
      (prompt + all tokens per chunk, official final). Pool memory per stream slot and per voice.
  wall (--parts wall): seconds of a whole segment's streaming render (flow + vocoder, every chunk) on
      the tiny model, one CPU thread: the old path (`Token2Wav3Stream`, re-render and whole-mel HiFT)
      against the runtime's `DiTChunkRenderer` (pool and HiFT windows), by length. Tiny widths make
      the DiT cheap next to the per-call overheads, so this shows the growth, not the full-size ratio.

    python bench/bench_cv3_final_chunk.py --golden ../shared/golden_cv3 --out bench/results/cv3_final_chunk.json
    python bench/bench_cv3_final_chunk.py --parts wall --out bench/results/cv3_stream_wall_cpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import GOLDEN3, _full_keys  # noqa: E402
from tts_core.flow.dit_flow import DiTFlowModel, dit_flow_config_from, load_dit_flow  # noqa: E402
from tts_core.flow.dit_pool import DiTContextPool, frame_bytes, shared_prompt_frames  # noqa: E402
from tts_core.model_config import load_model_yaml  # noqa: E402
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule  # noqa: E402

TINY_LENGTHS = (90, 250, 500)
FULL_LENGTHS = (100, 250, 500, 1000)  # speech tokens (25 a second): 4, 10, 20, 40 s
FULL_PROMPT = 150  # tokens of the full-size bench voice's prompt (bench/full_model.py: 6 s)
WINDOW_FRAMES = 700  # the runtime's default own-frame window (flow_context_s 14)


def full_dit_flow_on_meta(golden: Path) -> DiTFlowModel:
    state = {k: torch.empty(shape, device="meta") for k, shape in _full_keys(golden)["flow"].items()}
    cfg = dit_flow_config_from(load_model_yaml(golden / "full" / "cosyvoice3_full.yaml"), state)
    with torch.device("meta"):
        flow = DiTFlowModel(cfg).eval()
    return flow.to("meta")  # the noise buffer is drawn on the CPU


def tasks(schedule: ChunkSchedule, prompt_tokens: int, tokens: int) -> list:
    planner, out = ChunkPlanner(schedule, prompt_tokens), []
    while (task := planner.next_chunk(tokens, lm_finished=True)) is not None:
        out.append(task)
    return out


def add_voice(pool: DiTContextPool, flow: DiTFlowModel, prompt: tuple) -> int:
    pt, pf, emb = prompt
    frames = shared_prompt_frames(pf.size(1), pt.size(1), flow.cfg.token_mel_ratio, flow.cfg.pre_lookahead_len,
                                  pool.chunk)
    c = flow.condition(pt[:, :0], pt, pf, emb, True)
    pool.add_voice("voice", frames, c.mu, c.cond, c.spks)
    return frames


def pooled_call(pool: DiTContextPool, flow: DiTFlowModel, prompt: tuple, tokens: torch.Tensor, task) -> torch.Tensor:
    """One chunk of slot 0 through the pool -> its new frames (1, 80, n)."""
    pt, pf, emb = prompt
    c = flow.condition(tokens[:, :task.token_end], pt, pf, emb, task.finalize)
    row = pool.row(0, c.mu.size(2), keep=not task.finalize)
    mel = pool.solve([row], c.mu[:, :, row.start:], c.cond[:, :, row.start:], c.spks)
    pool.advance(0, row)
    return mel[:, :, c.prompt_frames + flow.cfg.token_mel_ratio * task.token_offset - row.start:]


def official(flow: DiTFlowModel, prompt: tuple, tokens: torch.Tensor, streaming: bool) -> torch.Tensor:
    """One flow call over prompt + all tokens (the official final call when not streaming)."""
    pt, pf, emb = prompt
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), emb, streaming=streaming, finalize=True)
    return mel


def flops(fn) -> tuple[object, float]:
    with FlopCounterMode(display=False) as counter:
        value = fn()
    return value, counter.get_total_flops()


def mel_difference(ours: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = (ours - reference).abs()
    return {"frames": ours.size(2), "max_abs": round(diff.max().item(), 4), "mean_abs": round(diff.mean().item(), 4),
            "official_mean_abs": round(reference.abs().mean().item(), 3)}


def tiny_differences(golden: Path, schedule: ChunkSchedule) -> list[dict]:
    torch.set_num_threads(1)
    flow = load_dit_flow(golden / "cosyvoice3_tiny")
    spk = torch.load(golden / "cosyvoice3_tiny" / "spk2info.pt", weights_only=False)["golden_speaker"]
    prompt = (spk["flow_prompt_speech_token"].long(), spk["prompt_speech_feat"], spk["flow_embedding"])
    case = torch.load(golden / "cases" / "flow.pt", weights_only=False)
    gen = torch.Generator().manual_seed(1)
    out = []
    for name, tokens, sched in [("golden", case["tokens"].long(), ChunkSchedule(
            case["hop"], case["max_hop"], case["stream_scale_factor"], case["pre_lookahead_len"]))] + [
            (f"random {n}", torch.randint(0, flow.cfg.vocab_size, (1, n), generator=gen), schedule)
            for n in TINY_LENGTHS]:
        pool = DiTContextPool(flow.decoder, 1, 2000, 200, torch.device("cpu"), torch.float32)
        add_voice(pool, flow, prompt)
        pool.start_stream(0, "voice")
        plan = tasks(sched, prompt[0].size(1), tokens.size(1))
        for task in plan:
            started = time.perf_counter()
            new = pooled_call(pool, flow, prompt, tokens, task)
            ours_s = time.perf_counter() - started
        started = time.perf_counter()
        full = official(flow, prompt, tokens, streaming=False)
        official_s = time.perf_counter() - started
        ref = full[:, :, -new.size(2):]
        out.append({"case": name, "tokens": tokens.size(1), "final_tokens": plan[-1].token_end - plan[-1].token_offset,
                    **mel_difference(new, ref), "final_call_s_ours": round(ours_s, 3),
                    "final_call_s_official": round(official_s, 3)})
        print(out[-1], flush=True)
    return out


def full_size(golden: Path, schedule: ChunkSchedule) -> dict:
    flow = full_dit_flow_on_meta(golden)
    meta = dict(device="meta")
    prompt = (torch.zeros(1, FULL_PROMPT, dtype=torch.long, **meta),
              torch.zeros(1, FULL_PROMPT * flow.cfg.token_mel_ratio, 80, **meta), torch.zeros(1, 192, **meta))
    est = flow.decoder.estimator
    chunk = est.cfg.static_chunk_size
    pool = DiTContextPool(flow.decoder, 1, WINDOW_FRAMES, 2 * FULL_PROMPT, torch.device("meta"), torch.float32)
    with torch.inference_mode():
        _, voice_flops = flops(lambda: add_voice(pool, flow, prompt))
        rows = []
        for length in FULL_LENGTHS:
            tokens = torch.zeros(1, length, dtype=torch.long, **meta)
            pool.start_stream(0, "voice")
            plan = tasks(schedule, FULL_PROMPT, length)
            pooled = [flops(lambda t=t: pooled_call(pool, flow, prompt, tokens, t))[1] for t in plan]
            rerender = [flops(lambda t=t: official(flow, prompt, tokens[:, :t.token_end], streaming=True))[1]
                        for t in plan[:-1]]
            _, official_final = flops(lambda: official(flow, prompt, tokens, streaming=False))
            tf = 1e12
            rows.append({
                "tokens": length, "seconds": length / 25, "calls": len(plan),
                "pooled_final_tflop": round(pooled[-1] / tf, 3), "pooled_segment_tflop": round(sum(pooled) / tf, 2),
                "official_final_tflop": round(official_final / tf, 2),
                "official_final_over_pooled_final": round(official_final / pooled[-1], 1),
                "pooled_segment_with_official_final_tflop": round((sum(pooled[:-1]) + official_final) / tf, 2),
                "added_by_official_final_pct": round(100 * (official_final - pooled[-1]) / sum(pooled)),
                "rerender_segment_tflop": round((sum(rerender) + official_final) / tf, 2),
                "rerender_over_pooled": round((sum(rerender) + official_final) / sum(pooled), 1),
                "first_chunk_tflop_pooled": round(pooled[0] / tf, 3),
            })
            print(rows[-1], flush=True)
    per_frame = frame_bytes(est, flow.decoder.n_timesteps, 2)
    return {"prompt_tokens": FULL_PROMPT, "schedule": schedule.__dict__, "window_frames": WINDOW_FRAMES,
            "voice_shared_frames": pool.voice_of[0].frames, "voice_shared_tflop_once": round(voice_flops / 1e12, 3),
            "frame_mb_bf16": round(per_frame / 2**20, 3),
            "slot_gb_bf16_at_window": round(per_frame * WINDOW_FRAMES / 2**30, 2),
            "slot_gb_bf16_per_10s": round(per_frame * 500 / 2**30, 2),
            "voice_gb_bf16_6s_prompt": round(per_frame * pool.voice_of[0].frames / 2**30, 2),
            "chunk_frames": chunk, "rows": rows}


def tiny_wall(golden: Path, schedule: ChunkSchedule) -> list[dict]:
    from tts_core.hift.causal import load_causal_hift
    from tts_core.runtime.chunk_render import FlowPoolSettings
    from tts_core.runtime.dit_render import DiTChunkRenderer
    from tts_core.streaming.token2wav3 import Token2Wav3Stream
    from tts_core.voices import VoiceBank

    torch.set_num_threads(1)
    tiny = golden / "cosyvoice3_tiny"
    flow, hift = load_dit_flow(tiny), load_causal_hift(tiny)
    bank = VoiceBank.load(tiny)
    voice = bank.get(bank.names()[0])
    gen = torch.Generator().manual_seed(2)
    out = []
    for length in TINY_LENGTHS + (1000,):
        tokens = torch.randint(0, flow.cfg.vocab_size, (length,), generator=gen).tolist()
        plan = tasks(schedule, len(voice.flow_prompt_speech_token), length)
        old = Token2Wav3Stream(flow, hift, torch.tensor([voice.flow_prompt_speech_token]),
                               voice.prompt_speech_feat[None], voice.flow_embedding[None], chunk_masked_final=True)
        started = time.perf_counter()
        for task in plan:
            old.render(tokens, task)
        old_s = time.perf_counter() - started
        renderer = DiTChunkRenderer(flow, hift, FlowPoolSettings(stream_slots=1, context_frames=2 * length + 100))
        renderer.prepare([voice], schedule, graphs=False)
        stream = renderer.stream(voice, schedule, None)
        started = time.perf_counter()
        for task in plan:
            renderer.render([(stream, tokens, task)])
        new_s = time.perf_counter() - started
        out.append({"tokens": length, "calls": len(plan), "old_s": round(old_s, 2), "pooled_s": round(new_s, 2),
                    "old_over_pooled": round(old_s / new_s, 1)})
        print(out[-1], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--golden", type=Path, default=GOLDEN3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--parts", default="full,tiny", help="any of full (FLOPs), tiny (difference), wall")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    schedule = ChunkSchedule()  # the runtime's default: first hop 25 (+ prompt pad), then 50
    report = {}
    if "full" in parts:
        report["full_size"] = full_size(args.golden, schedule)
    if "tiny" in parts:
        report["tiny_difference"] = tiny_differences(args.golden, schedule)
    if "wall" in parts:
        report["tiny_wall"] = tiny_wall(args.golden, schedule)
    text = json.dumps(report, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
