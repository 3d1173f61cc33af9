"""A shorter first hop (`first_hop_tokens`) against the official one: what it does to the audio (CPU, tiny model).

A call's first audio waits for its first hop + 3 lookahead tokens (28 decode steps with the official 25 + pad)
and the flow/vocoder call that renders them. A first hop of N tokens needs N + 3 steps, but its call ends inside
the flow's 25-token attention chunk: the first chunk's frames see a partial chunk (`ChunkPlanner` then cuts the
second hop so that it ends on the chunk grid again). For each first hop this measures, on
the same tokens, against the official schedule's render (the streaming flow as the official re-run computes it,
`IncrementalFlow`; the vocoder with the same excitation draw):

  first chunk   its mel frames against the official render's same frames (mean / max |difference| in log-mel,
                beside the mel's mean |value|), its audio's SNR against the official's same samples (beside
                the SNR of the official render against itself with another excitation draw: the noise floor);
  seam          the mel step from the first chunk's last frame to the next one, over the stream's median
                frame-to-frame step (the official render's step at the same frame beside it), and the level
                around the seam (10-ms RMS within 60 ms of it) against the official's, in dB;
  later         the frames after the first chunk: how many differ from the official's (> 1e-3) and by how much;
  unaligned     the same with the planner before the second hop was cut to the grid (every later call ended
                inside a chunk; a bench-only planner);
  cost          decode steps to the first chunk; the first flow call's CPU time and FLOPs on the tiny model (it
                renders the voice prompt's frames too, which the GPU runtime's pooled flow shares per voice).

Tokens: the golden case's 90 and seeded random sequences (the tiny model is random: its mel is not speech, so
the figures are relative). Golden parity tests pin the official schedule (ChunkSchedule() / hop 25 + pad).

    python bench/bench_first_hop.py --golden ../shared/golden --out bench/results/first_hop.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_final_chunk import stream_calls  # noqa: E402
from bench.full_model import GOLDEN  # noqa: E402
from tts_core.flow import FlowModel, load_flow  # noqa: E402
from tts_core.hift import HiftStream, load_hift  # noqa: E402
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule  # noqa: E402

FIRST_HOPS = (8, 10, 12, 15, 20)
RANDOM = ((250, 1), (250, 2), (250, 3))  # (tokens, seed) of the random sequences
SAMPLES_PER_FRAME = 480  # 24 kHz, 50 mel frames a second
LEVEL_FRAME, LEVEL_SPAN = 240, 1440  # 10-ms RMS frames within 60 ms of the seam
CHANGED = 1e-3  # a later frame "differs" beyond this (log-mel); parity tests hold 1e-4


class UnalignedPlanner(ChunkPlanner):
    """The planner before the second hop was cut to the chunk grid: every hop after the first the usual one, so
    after a first hop off the grid every later call ends inside a chunk too. Bench-only, for comparison."""

    @property
    def next_hop(self) -> int:
        return self._first_hop if self.chunks_emitted == 0 else self._hop


def render(flow: FlowModel, hift, prompt: tuple, tokens: torch.Tensor, schedule: ChunkSchedule,
           unaligned: bool = False, seed: int = 11) -> dict:
    """The stream's mel (1, 80, frames), audio, the first chunk's frames and the first call's CPU s / FLOPs."""
    with torch.inference_mode():
        calls = stream_calls(flow, prompt, tokens, schedule, UnalignedPlanner if unaligned else ChunkPlanner)
    vocoder = HiftStream(hift, torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        audio = [vocoder.push(mel, finalize=final)[0].double().numpy() for _, final, mel, _, _ in calls]
    return {"mel": torch.cat([c[2] for c in calls], 2).double(), "audio": np.concatenate(audio),
            "first_frames": calls[0][2].size(2), "first_samples": len(audio[0]), "calls": len(calls),
            "call_ends": [c[0] for c in calls], "first_cpu_s": calls[0][3], "first_gflop": calls[0][4] / 1e9}


def _steps(mel: torch.Tensor) -> torch.Tensor:
    return mel[0].diff(dim=1).abs().mean(0)  # mean |step| over the 80 bins, frame to frame


def _snr_db(ours: np.ndarray, ref: np.ndarray) -> float:
    n = min(len(ours), len(ref))
    noise = float(np.sum((ours[:n] - ref[:n]) ** 2))
    return round(10 * np.log10(float(np.sum(ref[:n] ** 2)) / noise), 1) if noise > 0 else float("inf")


def _level_db(audio: np.ndarray, ref: np.ndarray, at: int) -> float:
    """Max |10-ms RMS difference| in dB within LEVEL_SPAN samples of sample `at`."""
    lo, hi = max(0, at - LEVEL_SPAN), min(len(audio), len(ref), at + LEVEL_SPAN)
    n = (hi - lo) // LEVEL_FRAME

    def rms(x: np.ndarray) -> np.ndarray:
        return np.sqrt((x[lo:lo + n * LEVEL_FRAME].reshape(n, LEVEL_FRAME) ** 2).mean(1))

    return round(float(np.abs(20 * np.log10(rms(audio) / rms(ref))).max()), 2)


def compare(ours: dict, official: dict, noise_floor: dict) -> dict:
    first = ours["first_frames"]
    mel, ref = ours["mel"], official["mel"]
    d = (mel - ref).abs()
    steps, ref_steps = _steps(mel), _steps(ref)
    median = float(ref_steps.median())
    later = d[0, :, first:].amax(0)
    seam_sample = first * SAMPLES_PER_FRAME
    return {
        "first_chunk": {"frames": first, "mel_mean_abs": round(float(d[0, :, :first].mean()), 4),
                        "mel_max_abs": round(float(d[0, :, :first].max()), 4),
                        "mel_mean_abs_value": round(float(ref[0, :, :first].abs().mean()), 3),
                        "audio_snr_db": _snr_db(ours["audio"][:ours["first_samples"]], official["audio"]),
                        "audio_snr_db_other_draw": _snr_db(noise_floor["audio"][:ours["first_samples"]],
                                                           official["audio"])},
        "seam": {"step_over_median": round(float(steps[first - 1]) / median, 2),
                 "official_step_there_over_median": round(float(ref_steps[first - 1]) / median, 2),
                 "stream_p95_step_over_median": round(float(ref_steps.quantile(0.95)) / median, 2),
                 "level_db_max": _level_db(ours["audio"], official["audio"], seam_sample),
                 "level_db_max_other_draw": _level_db(noise_floor["audio"], official["audio"], seam_sample)},
        "later": {"frames": int(later.numel()), "frames_changed": int((later > CHANGED).sum()),
                  "mel_max_abs": round(float(later.max()), 4) if later.numel() else 0.0,
                  "mel_mean_abs": round(float(d[0, :, first:].mean()), 5) if later.numel() else 0.0},
        "calls": ours["calls"], "call_ends_tokens": ours["call_ends"],
    }


def token_set(flow: FlowModel, golden: Path, name: str) -> torch.Tensor:
    if name == "golden":
        return torch.load(golden / "cases" / "flow.pt", weights_only=False)["tokens"]
    length, seed = (int(x) for x in name.split("/"))
    return torch.randint(0, flow.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--first-hops", type=int, nargs="+", default=list(FIRST_HOPS))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    started = time.perf_counter()
    tiny = args.golden / "cosyvoice2_tiny"
    flow, hift = load_flow(tiny), load_hift(tiny, fold=True)
    speaker = next(iter(torch.load(tiny / "spk2info.pt", weights_only=False).values()))
    prompt = tuple(speaker[k] for k in ("flow_prompt_speech_token", "prompt_speech_feat", "flow_embedding"))
    official_schedule = ChunkSchedule()
    official_first = ChunkPlanner(official_schedule, prompt[0].size(1)).next_hop
    rows = []
    for name in ["golden"] + [f"{n}/{seed}" for n, seed in RANDOM]:
        tokens = token_set(flow, args.golden, name)
        official = render(flow, hift, prompt, tokens, official_schedule)
        other_draw = render(flow, hift, prompt, tokens, official_schedule, seed=12)
        row = {"tokens": name, "official": {
            "first_hop": official_first, "decode_steps": official_first + official_schedule.lookahead_tokens,
            "first_cpu_ms": round(official["first_cpu_s"] * 1e3, 1), "first_gflop": round(official["first_gflop"], 3),
            **compare(other_draw, official, other_draw)}}
        for hop in args.first_hops:
            schedule = ChunkSchedule(first_hop_tokens=hop)
            ours = render(flow, hift, prompt, tokens, schedule)
            unaligned = render(flow, hift, prompt, tokens, schedule, unaligned=True)
            row[str(hop)] = {"decode_steps": hop + schedule.lookahead_tokens,
                             "first_cpu_ms": round(ours["first_cpu_s"] * 1e3, 1),
                             "first_gflop": round(ours["first_gflop"], 3),
                             **compare(ours, official, other_draw),
                             "unaligned": compare(unaligned, official, other_draw)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {"what": __doc__.splitlines()[0], "command": "python " + " ".join(sys.argv),
              "date": time.strftime("%Y-%m-%d"), "model": "tiny golden (random weights), CPU fp32, one thread",
              "prompt_tokens": int(prompt[0].size(1)), "official_first_hop": official_first,
              "rows": rows,
              "seconds": round(time.perf_counter() - started, 1)}
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
