"""Render the due chunks of many jobs at once: one batched flow call per call shape, then each
job's own vocoder (the fast path of the scheduler; `Token2WavStream` is the exact per-job path).

Owns the voices' device-side flow prompts (built once per voice, shared by all its streams) and the
captured flow/HiFT graphs. Driven only by the scheduler thread.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tts_core.flow import FlowModel
from tts_core.hift import HiftGenerator
from tts_core.runtime.chunk_vocoder import ChunkVocoder
from tts_core.runtime.window_flow import FlowRequest, VoiceFlowPrompt, WindowFlowRunner, flow_window, steady_shapes
from tts_core.streaming.chunk_schedule import ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import RenderedChunk
from tts_core.voices import Voice


@dataclass
class WindowedStream:
    """One job segment's state on the fast path: its voice prompt and its vocoder caches."""

    prompt: VoiceFlowPrompt
    vocoder: ChunkVocoder
    schedule: ChunkSchedule
    finished: bool = False


class ChunkRenderer:
    def __init__(self, flow: FlowModel, hift: HiftGenerator, window_tokens: int) -> None:
        self.flow, self.hift = flow, hift
        self.window_tokens = window_tokens
        self.runner = WindowFlowRunner(flow)
        self.hift_graphs: dict[tuple[int, int], object] = {}
        self._prompts: dict[str, tuple[Voice, VoiceFlowPrompt]] = {}
        self._hift_dtype = next(hift.parameters()).dtype
        self._device = self.runner.device

    def prompt(self, voice: Voice) -> VoiceFlowPrompt:
        known = self._prompts.get(voice.name)
        if known is None or known[0] is not voice:
            known = (voice, VoiceFlowPrompt.build(self.flow, voice))
            self._prompts[voice.name] = known
        return known[1]

    def stream(self, voice: Voice, schedule: ChunkSchedule, generator: torch.Generator | None) -> WindowedStream:
        return WindowedStream(self.prompt(voice), ChunkVocoder(self.hift, generator, self.hift_graphs), schedule)

    def capture(self, voices: Sequence[Voice], schedule: ChunkSchedule, flow_batches: Sequence[int]) -> dict:
        """Capture flow graphs for each voice prompt length and HiFT graphs for the steady chunk
        sizes (CUDA start-up). Returns what was captured, for the start-up report."""
        from tts_core.accel.hift_graphs import GraphedHift

        ratio = self.flow.cfg.token_mel_ratio
        shapes: dict[int, list] = {}
        for voice in voices:
            p = len(voice.flow_prompt_speech_token)
            if p in shapes:
                continue
            shapes[p] = steady_shapes(schedule, p, self.window_tokens, ratio)
            self.runner.capture(self.prompt(voice), shapes[p], flow_batches)
            # HiFT: first chunk (no caches) and later chunks (8 cached frames + a full hop).
            first = shapes[p][0][0] - schedule.lookahead_tokens
            for frames, cached in ((first * ratio, 0), (8 + schedule.max_hop_tokens * ratio, 8 * 480)):
                if (frames, cached) not in self.hift_graphs:
                    self.hift_graphs[(frames, cached)] = GraphedHift(self.hift, frames, cached)
        return {"flow_shapes": {str(p): s for p, s in shapes.items()}, "flow_batches": list(flow_batches),
                "flow_graphs": len(self.runner.graphs), "hift_graphs": sorted(self.hift_graphs)}

    def render(self, items: Sequence[tuple[WindowedStream, Sequence[int], ChunkTask]]) -> list[RenderedChunk]:
        """One chunk per item (stream, the segment's tokens so far, its task), in the same order.
        The flow time is the batched call's, shared by all items."""
        started = time.perf_counter()
        ratio = self.flow.cfg.token_mel_ratio
        requests = [FlowRequest(s.prompt, tokens, flow_window(task, s.schedule, self.window_tokens, ratio))
                    for s, tokens, task in items]
        mels = self.runner.render(requests)
        flow_done = _synchronized(self._device)
        out = []
        for (stream, _, task), mel in zip(items, mels):
            t0 = time.perf_counter()
            wav = stream.vocoder.push(mel.to(self._hift_dtype), finalize=task.finalize)
            audio = wav[0].float().cpu().numpy()
            stream.finished = task.finalize
            out.append(RenderedChunk(audio=np.ascontiguousarray(audio), mel=mel, flow_s=flow_done - started,
                                     hift_s=time.perf_counter() - t0))
        return out


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
