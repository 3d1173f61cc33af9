"""One request's token -> waveform streaming state: the flow renders new mel frames, HiFT voices them.

The official CosyVoice2 `token2wav` re-runs the flow over the prompt and all tokens so far with
streaming (chunk-causal) masks and keeps the frames from `token_offset * 2` on; it then vocodes them
with an 8-frame mel cache, a 3840-sample source cache and a Hamming cross-fade. Here `IncrementalFlow`
computes the same frames without the re-run (each frame once; see tts_core.flow.incremental) and
`HiftStream` holds the vocoder caches. The official loop makes its last call without `stream` (a
full-attention re-render of everything); ours renders the final chunk chunk-masked like the others,
a stated deviation (README; figures in docs/PERF_NOTES.md, "The final chunk"). Both are per request, so
nothing request-specific lives on the shared models.

Not thread-safe: one instance per request segment, driven by the scheduler's thread. The caller
passes every token of the segment so far and the `ChunkTask` that the request's `ChunkPlanner`
issued; the result is the 24 kHz float32 audio that became final with this chunk.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tts_core.flow import FlowModel
from tts_core.flow.incremental import IncrementalFlow
from tts_core.hift import HiftGenerator, HiftStream
from tts_core.streaming.chunk_schedule import ChunkTask
from tts_core.voices import Voice


@dataclass(frozen=True)
class RenderedChunk:
    audio: np.ndarray  # (samples,) float32 at 24 kHz
    mel: torch.Tensor  # (1, 80, new_frames) the flow's new frames, as the vocoder received them
    flow_s: float
    hift_s: float
    # Stream time of the flow call's encoder and solve, where measured (PooledFlowGraphs.time_gpu).
    flow_gpu_s: tuple[float, float] | None = None
    # The vocoder call's host launch time and its time on the stream, where measured (ChunkRenderer.time_gpu).
    hift_gpu_s: tuple[float, float] | None = None


class Token2WavStream:
    def __init__(self, flow: FlowModel, hift: HiftGenerator, voice: Voice, generator: torch.Generator) -> None:
        """`generator` lives on the vocoder's device and draws this request's excitation noise."""
        self._device = flow.input_embedding.weight.device
        dtype = flow.input_embedding.weight.dtype
        prompt_token = torch.tensor([voice.flow_prompt_speech_token], dtype=torch.long, device=self._device)
        prompt_feat = voice.prompt_speech_feat[None].to(self._device, dtype)
        embedding = voice.flow_embedding[None].to(self._device, dtype)
        self._flow = IncrementalFlow(flow, prompt_token.reshape(1, -1), prompt_feat, embedding)
        self._ratio = flow.cfg.token_mel_ratio
        self._hift_dtype = next(hift.parameters()).dtype
        self._hift = HiftStream(hift, generator)
        self.finished = False

    def render(self, tokens: Sequence[int], task: ChunkTask) -> RenderedChunk:
        """Render `task` given the segment's tokens so far (at least `task.token_end` of them)."""
        if len(tokens) < task.token_end:
            raise ValueError(f"chunk {task.index} needs {task.token_end} tokens, {len(tokens)} exist")
        if task.token_offset * self._ratio != self._flow.frames_emitted:
            raise ValueError(f"chunk {task.index} starts at token {task.token_offset}, but "
                             f"{self._flow.frames_emitted // self._ratio} tokens are rendered")
        started = time.perf_counter()
        token_tensor = torch.tensor([list(tokens[:task.token_end])], dtype=torch.long, device=self._device)
        mel = self._flow.render(token_tensor, task.finalize)
        flow_done = _synchronized(self._device)
        wav = self._hift.push(mel.to(self._hift_dtype), finalize=task.finalize)
        audio = wav[0].float().cpu().numpy()  # the copy to host waits for the device
        hift_done = time.perf_counter()
        self.finished = task.finalize
        return RenderedChunk(audio=audio, mel=mel, flow_s=flow_done - started, hift_s=hift_done - flow_done)


def _synchronized(device: torch.device) -> float:
    """Wall time after the device finished its queued work, so flow and HiFT times split honestly."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
