"""CosyVoice3's stages in one dtype against the official float32 golden outputs (tiny golden model,
../shared/golden_cv3): the max abs difference of each stage, for bench/bench_cv3_dtypes.py.

The parts are built by the runtime's own loader (`runtime/family.py`: LM and DiT flow in the dtype, the causal
HiFT in float32 whatever the dtype) and the streamed chunks come from the runtime's renderer
(`runtime/dit_render.py`), fed the golden tokens on the official schedule. Stages:
- `lm_logp`: teacher-forced log-probs (cases/llm.pt `logp_full`, magnitude ~10);
- `dit_estimator_stream`: one chunk-masked DiT call (cases/flow.pt `estimator_call`, output ~5);
- `flow_mel_nonstream`: the full-attention render of all 90 tokens (`mel_nonstream`, mel ~25);
- `runtime_stream_mel`: the renderer's chunks' mel against the official streaming mel (token2wav_stream.pt);
- `runtime_stream_audio_mean`: mean abs difference of its audio from the official chunks (this random tiny
  HiFT amplifies its input's rounding ~1e4 times, so a max is meaningless; the mean and the energy are not);
- `runtime_stream_rms_ratio`: its audio's RMS over the official chunks' (1.0: as loud);
- `hift_rms_ratio`: the float32 vocoder's RMS on this dtype's `flow_mel_nonstream` over its RMS on the golden
  mel (as bench/results/golden_dtypes_cuda_h100.json for CosyVoice2).
Every output is also checked finite (`finite`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def _diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        raise ValueError(f"shape {tuple(got.shape)} where the golden output has {tuple(want.shape)}")
    return round((got.float().cpu() - want.float()).abs().max().item(), 6)


def _rms(x: torch.Tensor | np.ndarray) -> float:
    x = torch.as_tensor(x).double()
    return x.pow(2).mean().sqrt().item()


@torch.inference_mode()
def golden_parity(golden: Path, device: torch.device, dtype: torch.dtype) -> dict:
    from tts_core.model_dir import ModelDir
    from tts_core.runtime.chunk_render import FlowPoolSettings
    from tts_core.runtime.dit_render import DiTChunkRenderer
    from tts_core.runtime.family import COSYVOICE3
    from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule
    from tts_core.voices import VoiceBank

    tiny = golden / "cosyvoice3_tiny"
    cases = {name: torch.load(golden / "cases" / f"{name}.pt", weights_only=False)
             for name in ("llm", "flow", "token2wav_stream")}
    with torch.device(device):
        parts = COSYVOICE3.load(ModelDir.open(tiny), device, dtype)
    lm, flow, hift = parts.lm, parts.flow, parts.hift
    out: dict = {}
    finite: dict[str, bool] = {}

    def check(stage: str, got: torch.Tensor, want: torch.Tensor) -> None:
        finite[stage] = bool(torch.isfinite(got).all())
        out[stage] = _diff(got, want)

    llm = cases["llm"]
    lm_input = lm.build_prefill_input(llm["text_token"], llm["prompt_text_token"], llm["prompt_speech_token"])
    forced = lm.speech_embedding(llm["forced_tokens"].long().to(device))
    rows = llm["logp_full"].shape[0]
    check("lm_logp", lm.teacher_forced_logp(torch.cat([lm_input, forced]))[-rows:], llm["logp_full"])

    case = cases["flow"]
    call = case["estimator_call"]
    x, mask, mu, t, spks, cond = (v.to(device, dtype) for v in call["inputs"])
    est = flow.decoder.estimator
    check("dit_estimator_stream", est(x, mask, mu, t, spks, cond, est.attention_mask(x.size(2), True, device)),
          call["output"])

    speaker = next(iter(torch.load(tiny / "spk2info.pt", weights_only=False).values()))
    pt, pf = speaker["flow_prompt_speech_token"].to(device), speaker["prompt_speech_feat"].to(device, dtype)
    tokens = case["tokens"].to(device)
    mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), speaker["flow_embedding"].to(device, dtype),
                            streaming=False, finalize=True)
    check("flow_mel_nonstream", mel, case["mel_nonstream"])
    ours, _ = hift.inference(mel.float(), finalize=True)
    golden_wav, _ = hift.inference(case["mel_nonstream"].to(device), finalize=True)
    finite["hift_on_mel_nonstream"] = bool(torch.isfinite(ours).all())
    out["hift_rms_ratio"] = round(_rms(ours.cpu()) / _rms(golden_wav.cpu()), 5)

    stream_case = cases["token2wav_stream"]
    schedule = ChunkSchedule(hop_tokens=case["hop"], max_hop_tokens=case["max_hop"],
                             hop_scale=case["stream_scale_factor"], lookahead_tokens=case["pre_lookahead_len"])
    bank = VoiceBank.load(tiny)
    voice = bank.get(bank.names()[0])
    # the official final call (full attention): the golden stream ends with it; the product default is
    # chunk-masked (docs/PERF_NOTES.md), checked against this case by tests/tts_core/test_runtime_cv3.py
    renderer = DiTChunkRenderer(flow, hift, FlowPoolSettings(stream_slots=1, official_final=True))
    stream = renderer.stream(voice, schedule, None)
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    golden_tokens = stream_case["tokens"][0].tolist()
    chunks = []
    while (task := planner.next_chunk(len(golden_tokens), lm_finished=True)) is not None:
        chunks.extend(renderer.render([(stream, golden_tokens, task)]))
    check("runtime_stream_mel", torch.cat([c.mel.float().cpu() for c in chunks], dim=2), stream_case["hift_mel_final"])
    audio = np.concatenate([c.audio for c in chunks])
    official = torch.cat(stream_case["chunks"], dim=1)[0].numpy()
    finite["runtime_stream_audio"] = bool(np.isfinite(audio).all())
    out["runtime_stream_chunks"] = [len(chunks), len(stream_case["chunks"])]
    if audio.size == official.size:
        out["runtime_stream_audio_mean"] = round(float(np.abs(audio - official).mean()), 6)
    out["runtime_stream_rms_ratio"] = round(_rms(audio) / _rms(official), 5)
    out["finite"] = finite
    return out
