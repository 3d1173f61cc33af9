"""CosyVoice3 streaming token2wav against the official `CosyVoice3Model.tts(stream=True)` chunks
(cases/token2wav_stream.pt): the chunk schedule, each call's mel and the emitted waveform chunks.

Tolerance as test_golden3_hift.py: HiFT's exp/ISTFT amplifies float32 noise to ~2e-4 on this
random model (a float64 run is as far from the official output); a seam or an off-by-one offset
would move whole chunks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.flow.dit_flow import DiTFlowModel, load_dit_flow
from tts_core.hift.causal import CausalHiftGenerator, load_causal_hift
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule
from tts_core.streaming.token2wav3 import Token2Wav3Stream

WAV_TOL = 1e-3
WAV_MEAN_TOL = 1e-5
MEL_TOL = 1e-4


@pytest.fixture(scope="module")
def models(tiny3_model_dir: Path) -> tuple[DiTFlowModel, CausalHiftGenerator]:
    torch.set_num_threads(1)
    return load_dit_flow(tiny3_model_dir), load_causal_hift(tiny3_model_dir)


@pytest.fixture(scope="module")
def case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "token2wav_stream.pt", weights_only=False)


@pytest.fixture(scope="module")
def flow_case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "flow.pt", weights_only=False)


def test_stream_matches_official_chunks(models, case: dict, flow_case: dict, tiny3_model_dir: Path) -> None:
    flow, hift = models
    speaker = next(iter(torch.load(tiny3_model_dir / "spk2info.pt", weights_only=False).values()))
    prompt = speaker["flow_prompt_speech_token"]
    schedule = ChunkSchedule(hop_tokens=flow_case["hop"], max_hop_tokens=flow_case["max_hop"],
                             hop_scale=flow_case["stream_scale_factor"], lookahead_tokens=flow.cfg.pre_lookahead_len)
    planner = ChunkPlanner(schedule, prompt.size(1))
    stream = Token2Wav3Stream(flow, hift, prompt, speaker["prompt_speech_feat"], speaker["flow_embedding"])
    tokens = case["tokens"][0].tolist()
    chunks, hops = [], []
    # Voice-conversion entry: every token exists from the start and the LM has finished.
    while (task := planner.next_chunk(len(tokens), lm_finished=True)) is not None:
        call = case["calls"][task.index]
        assert (task.token_end, task.token_offset, task.finalize) == (
            call["n_tokens"], call["token_offset"], call["finalize"])
        assert (not task.finalize) == call["flow_streaming"]
        assert stream.speech_offset == call["speech_offset_before"]
        frames_before = stream.mel.size(2)
        chunks.append(stream.render(tokens, task))
        hops.append(task.token_end - task.token_offset - (0 if task.finalize else schedule.lookahead_tokens))
        assert stream.mel.size(2) - frames_before == call["mel_new_frames"]
        assert stream.mel.size(2) == call["hift_mel_frames"]
        assert chunks[-1].size(1) == call["chunk_samples"]
    assert hops == case["hop_schedule"]
    assert len(chunks) == len(case["chunks"])
    assert (stream.mel - case["hift_mel_final"]).abs().max().item() <= MEL_TOL
    for ours, official in zip(chunks, case["chunks"], strict=True):
        diff = (ours - official).abs()
        assert diff.max().item() <= WAV_TOL
        assert diff.mean().item() <= WAV_MEAN_TOL
