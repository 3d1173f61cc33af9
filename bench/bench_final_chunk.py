"""The official CosyVoice2 final chunk against ours: what differs, and what matching it would cost (CPU).

The official streaming `tts()` makes its last token2wav call without `stream`: the flow re-renders
the prompt and every token with full attention (encoder and estimator) and keeps the frames after
the last chunk (its frames equal `mel_nonstream`'s tail; ../shared/golden/README.md, correction of
2026-11-26). Ours renders the final chunk like every other: chunk-causal, new frames only.

  difference (tiny golden model, CPU fp32): the final chunk's mel, ours against the official (the
      golden mel_nonstream tail), and its audio through the streaming vocoder with the same
      excitation draw: SNR and level difference in dB; the mel step at the seam before the final
      chunk (the official final frames come from another render than the frames before them);
      the same for random token sequences of several lengths.
  cost: FLOPs (torch.utils.flop_counter) of our final call, of our whole stream (every chunk), and
      of the official final call, by utterance length: the tiny model on CPU (with wall times,
      one thread) and the full-size flow (shapes from ../shared/golden/full, counted on the meta
      device, nothing allocated), there also on the GPU runtime's pooled path ("pooled_*": the
      context re-projected every call, the voice prompt's shared frames not counted, the
      defaults' 14 s of own frames and 50-token encoder window).

    python bench/bench_final_chunk.py --golden ../shared/golden --out bench/results/final_chunk.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.full_model import GOLDEN, full_flow_on_meta  # noqa: E402
from tts_core.flow import FlowModel, load_flow  # noqa: E402
from tts_core.flow.context_pool import PoolShape  # noqa: E402
from tts_core.flow.incremental import IncrementalFlow  # noqa: E402
from tts_core.flow.pooled import PooledFlow  # noqa: E402
from tts_core.hift import HiftStream, load_hift  # noqa: E402
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule  # noqa: E402

TINY_LENGTHS = (90, 250, 500)  # speech tokens of an utterance (25 per second)
FULL_LENGTHS = (100, 250, 500, 1000)
FULL_PROMPT = 150  # tokens of the full-size bench voice's prompt (bench/full_model.py: 6 s)
POOL_FRAMES, ENCODER_TOKENS = 700, 50  # the GPU runtime's defaults (flow_context_s 14, flow_encoder_tokens)


def official_final(flow: FlowModel, prompt: tuple, tokens: torch.Tensor) -> torch.Tensor:
    """What the official last call renders: all frames after the prompt, full attention."""
    pt, pf, emb = prompt
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), emb, streaming=False, finalize=True)
    return mel


def stream_calls(flow: FlowModel, prompt: tuple, tokens: torch.Tensor, schedule: ChunkSchedule,
                 planner_class: type[ChunkPlanner] = ChunkPlanner,
                 ) -> list[tuple[int, bool, torch.Tensor, float, float]]:
    """Our chunk calls for `tokens` (all of them known: the schedule as the LM would trigger it):
    (tokens read, finalize, new mel, seconds, FLOPs) per call."""
    renderer = IncrementalFlow(flow, *prompt)
    planner = planner_class(schedule, prompt[0].size(1))
    out = []
    while (task := planner.next_chunk(tokens.size(1), lm_finished=True)) is not None:
        started = time.perf_counter()
        with FlopCounterMode(display=False) as counter:
            mel = renderer.render(tokens[:, :task.token_end], task.finalize)
        out.append((task.token_end, task.finalize, mel, time.perf_counter() - started, counter.get_total_flops()))
    return out


def timed_flops(fn) -> tuple[object, float, float]:
    started = time.perf_counter()
    with FlopCounterMode(display=False) as counter:
        value = fn()
    return value, time.perf_counter() - started, counter.get_total_flops()


def mel_difference(ours: torch.Tensor, official: torch.Tensor) -> dict:
    d = (ours.double() - official.double()).abs()
    return {"max_abs": round(float(d.max()), 4), "mean_abs": round(float(d.mean()), 4),
            "mean_abs_official": round(float(official.abs().mean()), 4)}


def seam_step(before: torch.Tensor, after: torch.Tensor) -> float:
    """Mean |mel step| (over bins) from the last frame before the final chunk to its first frame."""
    return round(float((after[0, :, 0] - before[0, :, -1]).abs().mean()), 4)


def audio_difference(hift, mels_before: list[torch.Tensor], ours: torch.Tensor, official: torch.Tensor) -> dict:
    """The final chunk's audio through the streaming vocoder, ours and official, with the same
    excitation draws (the chunks before are the same mels in both)."""
    finals = []
    for final in (ours, official):
        stream = HiftStream(hift, torch.Generator().manual_seed(11))
        for mel in mels_before:
            stream.push(mel)
        finals.append(stream.push(final, finalize=True)[0].double().numpy())
    a, b = finals
    noise = float(np.sum((a - b) ** 2))
    return {"final_samples": len(a), "snr_db": round(10 * np.log10(float(np.sum(b ** 2)) / noise), 1),
            "level_diff_db": round(20 * np.log10(np.sqrt(np.mean(a ** 2)) / np.sqrt(np.mean(b ** 2))), 3)}


def golden_case(golden: Path, flow: FlowModel, hift) -> dict:
    case = torch.load(golden / "cases" / "flow.pt", weights_only=False)
    speaker = next(iter(torch.load(golden / "cosyvoice2_tiny" / "spk2info.pt", weights_only=False).values()))
    prompt = tuple(speaker[k] for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))
    tokens = case["tokens"]
    first = case["first_hop"] + case["pre_lookahead_len"]
    renderer = IncrementalFlow(flow, *prompt)
    with torch.inference_mode():
        mels = [renderer.render(tokens[:, :n], fin) for n, fin in
                ((first, False), (first + case["hop"], False), (tokens.size(1), True))]
        ours_nonstream = official_final(flow, prompt, tokens)
    done = sum(m.size(2) for m in mels[:-1])
    official = case["mel_nonstream"][:, :, done:]
    return {"tokens": tokens.size(1), "final_frames": official.size(2),
            "ours_nonstream_vs_golden_max_abs": float((ours_nonstream - case["mel_nonstream"]).abs().max()),
            "mel": mel_difference(mels[-1], official),
            "seam_step": {"ours": seam_step(mels[-2], mels[-1]), "official": seam_step(mels[-2], official),
                          "median_frame_step": round(float(torch.cat(mels, 2).diff(dim=2).abs().mean(1).median()), 4)},
            "audio": audio_difference(hift, mels[:-1], mels[-1], official)}


def random_case(flow: FlowModel, hift, prompt: tuple, length: int, schedule: ChunkSchedule) -> dict:
    tokens = torch.randint(0, flow.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    with torch.inference_mode():
        calls = stream_calls(flow, prompt, tokens, schedule)
        full, full_s, full_flops = timed_flops(lambda: official_final(flow, prompt, tokens))
    done = sum(c[2].size(2) for c in calls[:-1])
    ours = calls[-1][2]
    official = full[:, :, done:]
    return {"tokens": length, "calls": len(calls), "final_tokens": ours.size(2) // flow.cfg.token_mel_ratio,
            "mel": mel_difference(ours, official),
            "seam_step": {"ours": seam_step(calls[-2][2], ours), "official": seam_step(calls[-2][2], official)},
            "audio": audio_difference(hift, [c[2] for c in calls[:-1]], ours, official),
            "cpu_s": {"ours_final": round(calls[-1][3], 4), "ours_stream": round(sum(c[3] for c in calls), 4),
                      "official_final": round(full_s, 4)},
            "gflop": {"ours_final": round(calls[-1][4] / 1e9, 3), "ours_stream": round(sum(c[4] for c in calls) / 1e9, 3),
                      "official_final": round(full_flops / 1e9, 3)}}


def pooled_call_flops(pooled: PooledFlow, voice, tokens: torch.Tensor, schedule: ChunkSchedule) -> list[float]:
    """FLOPs of each chunk call of one stream on the GPU runtime's path (`PooledFlow`: the voice's
    shared prompt frames computed at registration, not here; the context re-projected every call)."""
    stream = pooled.open_stream(voice)
    planner = ChunkPlanner(schedule, voice.prompt_token.size(1))
    flops = []
    while (task := planner.next_chunk(tokens.size(1), lm_finished=True)) is not None:
        with FlopCounterMode(display=False) as counter:
            pooled.render([stream], [tokens[:, :task.token_end]], [task.finalize])
        flops.append(counter.get_total_flops())
    pooled.close_stream(stream)
    return flops


def full_size_flops(golden: Path, schedule: ChunkSchedule) -> list[dict]:
    flow = full_flow_on_meta(golden)
    meta = dict(device="meta")
    prompt = (torch.zeros(1, FULL_PROMPT, dtype=torch.long, **meta),
              torch.zeros(1, FULL_PROMPT * flow.cfg.token_mel_ratio, 80, **meta), torch.zeros(1, 192, **meta))
    # The runtime's defaults on CUDA: 700 own frames (flow_context_s 14), a 50-token encoder window.
    chunk = flow.cfg.estimator.static_chunk_size
    voice_frames = -(-prompt[1].size(1) // chunk) * chunk
    pooled = PooledFlow(flow, PoolShape(1, POOL_FRAMES, 1, voice_frames, voice_frames + 2 * chunk), ENCODER_TOKENS)
    rows = []
    with torch.inference_mode():
        voice = pooled.register_voice(*prompt)
        for length in FULL_LENGTHS:
            tokens = torch.zeros(1, length, dtype=torch.long, **meta)
            calls = stream_calls(flow, prompt, tokens, schedule)
            in_pool = pooled_call_flops(pooled, voice, tokens, schedule)
            _, _, full = timed_flops(lambda: official_final(flow, prompt, tokens))
            rows.append({"tokens": length, "seconds_of_speech": length / 25, "calls": len(calls),
                         "tflop": {"ours_final": round(calls[-1][4] / 1e12, 3),
                                   "ours_stream": round(sum(c[4] for c in calls) / 1e12, 3),
                                   "pooled_final": round(in_pool[-1] / 1e12, 3),
                                   "pooled_stream": round(sum(in_pool) / 1e12, 3),
                                   "official_final": round(full / 1e12, 3)}})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tiny = args.golden / "cosyvoice2_tiny"
    flow, hift = load_flow(tiny), load_hift(tiny, fold=True)
    speaker = next(iter(torch.load(tiny / "spk2info.pt", weights_only=False).values()))
    prompt = tuple(speaker[k] for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))
    schedule = ChunkSchedule()  # the runtime's default: first hop 25 (+ pad), then 50
    report = {"golden": golden_case(args.golden, flow, hift),
              "tiny_random": [random_case(flow, hift, prompt, n, schedule) for n in TINY_LENGTHS],
              "full_size": full_size_flops(args.golden, schedule),
              "schedule": {"hop_tokens": schedule.hop_tokens, "max_hop_tokens": schedule.max_hop_tokens},
              "full_prompt_tokens": FULL_PROMPT, "threads": torch.get_num_threads()}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
