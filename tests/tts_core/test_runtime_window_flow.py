"""The bounded-window batched flow path: exact where the window covers everything, close otherwise."""

from __future__ import annotations

from pathlib import Path

import torch

from tts_core.flow import load_flow
from tts_core.runtime.window_flow import FlowRequest, VoiceFlowPrompt, WindowFlowRunner, flow_window
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule
from tts_core.voices import VoiceBank


def _chunks(tiny_model_dir: Path, window: int, total: int = 130):
    flow = load_flow(tiny_model_dir)
    bank = VoiceBank.load(tiny_model_dir)
    voice = bank.get(bank.names()[0])
    prompt = VoiceFlowPrompt.build(flow, voice)
    tokens = torch.randint(0, flow.cfg.vocab_size, (total,), generator=torch.Generator().manual_seed(0)).tolist()
    schedule = ChunkSchedule()
    planner = ChunkPlanner(schedule, len(voice.flow_prompt_speech_token))
    runner = WindowFlowRunner(flow)
    for n in range(1, total + 1):
        while (task := planner.next_chunk(n, n == total)) is not None:
            # Two copies of the stream in one batch: rows must not leak into each other.
            request = FlowRequest(prompt, tokens, flow_window(task, schedule, window, 2))
            mel, twin = runner.render([request, request])
            t = torch.tensor([tokens[:task.token_end]])
            ref, _ = flow.inference(t, torch.tensor([t.size(1)]), prompt.token, torch.tensor([prompt.token.size(1)]),
                                    prompt.feat, torch.tensor([prompt.feat.size(1)]), voice.flow_embedding[None],
                                    True, task.finalize)
            yield mel, twin, ref[:, :, task.token_offset * 2:]


def test_window_covering_everything_equals_official_streaming_call(tiny_model_dir: Path) -> None:
    for mel, twin, ref in _chunks(tiny_model_dir, window=1000):
        assert mel.shape == ref.shape
        # Batch 2 vs the official batch 1: same arithmetic, different matmul blocking (float32 rounding).
        torch.testing.assert_close(mel, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(twin, mel, rtol=1e-4, atol=1e-4)


def test_short_window_stays_close_to_official(tiny_model_dir: Path) -> None:
    # Measured on the tiny model: 1.6 % relative difference once context falls out of the window.
    for mel, _, ref in _chunks(tiny_model_dir, window=25):
        assert float((mel - ref).norm() / ref.norm()) < 0.05
