"""Render the due chunks of CosyVoice3 jobs: the DiT flow and the causal HiFT, streamed exactly as the
official `CosyVoice3Model.token2wav` (tts_core/streaming/token2wav3.py is the one-request reference).

CosyVoice3's per-stream state is small: the mel rendered so far and the samples already emitted.
It lives in preallocated slots (`DiTSlots`, one row per stream slot, as long as the flow's fixed
noise: an utterance cannot be longer), taken when a segment's rendering starts and given back at
its final chunk or when its job leaves. Each chunk re-renders prompt + every token so far
(chunk-masked; full attention for the final chunk, as the official loop does), appends the new
frames to the slot and re-runs the causal HiFT over the slot's mel, emitting the samples past
those already sent: no cache, no cross-fade, no seam.

Same interface as `chunk_render.ChunkRenderer` (lanes, `stream`, `render`, `prepare`), so the
scheduler and render lanes serve both families. A render call's chunks go through the DiT in one
batched solve per attention kind (rows right-padded and masked), then each stream's vocoder runs
alone. Eager on every device for now: no CUDA graphs, no compiled flow. Its cost grows with the
utterance (every chunk re-renders it all), as the official's does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from tts_core.flow.dit_flow import DiTFlowModel
from tts_core.hift.causal import CausalHiftGenerator
from tts_core.runtime.chunk_render import FlowPoolSettings, RenderLane
from tts_core.streaming.chunk_schedule import ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import RenderedChunk
from tts_core.voices import Voice

log = structlog.get_logger(__name__)


class DiTSlots:
    """Per-stream state of CosyVoice3 streaming, one row per slot: mel so far and samples emitted."""

    def __init__(self, slots: int, mel_bins: int, max_frames: int, device: torch.device) -> None:
        self.mel = torch.zeros(slots, mel_bins, max_frames, device=device)
        self.frames = [0] * slots
        self.emitted = [0] * slots
        self._free = list(range(slots))
        self._lock = threading.Lock()  # taken on a render thread, given back on the decode thread too

    def take(self) -> int:
        with self._lock:
            if not self._free:
                raise RuntimeError("no free CosyVoice3 stream slot")
            slot = self._free.pop(0)
        self.frames[slot] = self.emitted[slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        with self._lock:
            self._free.append(slot)

    def staged(self, slot: int, new: torch.Tensor) -> torch.Tensor:
        """The slot's mel so far with the chunk's frames (1, 80, n) after it, (1, 80, frames + n); nothing
        is kept until `commit` (a render that fails leaves the stream as it was, to be rendered again)."""
        at, n = self.frames[slot], new.size(2)
        if at + n > self.mel.size(2):
            raise ValueError(f"utterance exceeds {self.mel.size(2)} mel frames (the flow's noise buffer)")
        self.mel[slot, :, at:at + n] = new[0]
        return self.mel[slot:slot + 1, :, :at + n]

    def commit(self, slot: int, frames: int, samples: int) -> None:
        self.frames[slot] += frames
        self.emitted[slot] += samples


@dataclass(frozen=True)
class _VoicePrompt:
    token: torch.Tensor  # (1, N) long
    feat: torch.Tensor  # (1, 2N, 80) in the flow's dtype
    embedding: torch.Tensor  # (1, 192) in the flow's dtype


class DiTChunkStream:
    """One job segment's stream: its slot and its voice's flow prompt."""

    def __init__(self, renderer: DiTChunkRenderer, slot: int, prompt: _VoicePrompt) -> None:
        self.renderer, self.slot, self.prompt = renderer, slot, prompt
        self.finished = False
        # Under the renderer's lock: closed; being rendered by a lane; closed during that render (its
        # slot is given back when the render ends).
        self.closed = False
        self.rendering = False
        self.release_pending = False

    def close(self) -> None:
        """Give the slot back (idempotent; any thread: the decode thread closes a cancelled job's stream,
        perhaps while a lane renders its chunk; the slot is then given back when that render ends)."""
        self.renderer.close(self)


class DiTChunkRenderer:
    def __init__(self, flow: DiTFlowModel, hift: CausalHiftGenerator, settings: FlowPoolSettings) -> None:
        self.flow, self.hift = flow, hift
        self.settings = settings
        self._device = next(flow.parameters()).device
        self.slots = DiTSlots(settings.stream_slots, flow.cfg.output_size, flow.decoder.rand_noise.size(2),
                              self._device)
        self.lanes = {name: RenderLane(name, max_batch=max(settings.first_batches)) for name in self.first_lanes}
        self.lanes["later"] = RenderLane("later", max_batch=max(settings.batches))
        self._voices: dict[str, tuple[Voice, _VoicePrompt]] = {}
        self._voices_lock = threading.Lock()
        self._streams_lock = threading.Lock()  # DiTChunkStream.closed / .rendering
        self.time_gpu = False  # the vocoder is not timed on the stream here (eager)
        log.info("dit_stream_slots_allocated", stream_slots=settings.stream_slots,
                 gb=round(self.slots.mel.numel() * 4 / 2**30, 3))

    @property
    def first_lanes(self) -> list[str]:
        return [f"first-{i}" for i in range(self.settings.first_lanes)]

    @property
    def dtype(self) -> torch.dtype:
        return next(self.flow.parameters()).dtype

    @property
    def max_batch(self) -> int:
        return self.lanes["later"].max_batch

    def _prompt(self, voice: Voice) -> _VoicePrompt:
        with self._voices_lock:
            known = self._voices.get(voice.name)
            if known is None or known[0] is not voice:
                dtype = self.dtype
                prompt = _VoicePrompt(
                    torch.tensor([voice.flow_prompt_speech_token], dtype=torch.long, device=self._device),
                    voice.prompt_speech_feat[None].to(self._device, dtype),
                    voice.flow_embedding[None].to(self._device, dtype))
                if self._device.type == "cuda":
                    # Copied on this thread's stream; another lane may use it next.
                    torch.cuda.current_stream(self._device).synchronize()
                known = (voice, prompt)
                self._voices[voice.name] = known
            return known[1]

    def stream(self, voice: Voice, schedule: ChunkSchedule, generator: torch.Generator | None) -> DiTChunkStream:
        # `generator` is unused: CosyVoice3's flow and HiFT draw no random numbers (fixed noise buffers).
        return DiTChunkStream(self, self.slots.take(), self._prompt(voice))

    def close(self, stream: DiTChunkStream) -> None:
        with self._streams_lock:
            if stream.closed:
                return
            stream.closed = True
            if stream.rendering:
                stream.release_pending = True  # `render` gives the slot back when it is done with it
                return
        self.slots.give_back(stream.slot)

    def prepare(self, voices: Sequence[Voice], schedule: ChunkSchedule, graphs: bool) -> dict:
        """The voices' prompts on the device; no graphs (the CosyVoice3 flow and vocoder run eagerly)."""
        started = time.perf_counter()
        for voice in voices:
            self._prompt(voice)
        if graphs:
            log.info("dit_render_eager", why="CUDA graphs and compile cover the CosyVoice3 LM only; "
                     "its DiT flow and causal HiFT run eagerly")
        return {"flow_voices_s": time.perf_counter() - started, "flow_pool_gb": self.slots.mel.numel() * 4 / 2**30}

    def capture_compiled(self, stop=lambda: False) -> dict:
        """Nothing to compile or capture (the flow and vocoder run eagerly). The scheduler's tts-compile thread
        calls it after the LM's compiled decode graphs; without it that thread failed (compiled_graphs_failed,
        graphs "failed" in the health) on every CosyVoice3 GPU start."""
        return {}

    def has_deferred(self) -> bool:
        return False

    def capture_deferred(self, stop=lambda: False) -> None:
        """Nothing is deferred (no graphs)."""

    @torch.inference_mode()
    def render(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
               lane: str = "later") -> list[RenderedChunk]:
        """One chunk per item (stream, the segment's flow tokens so far, its task), in order. The flow
        renders the items' chunks in one batched call per attention kind (chunk-masked, and full for
        final chunks); each stream's vocoder then runs on its own mel. A stream whose final chunk this is
        gives its slot back."""
        with self._streams_lock:
            # A stream closed since its lane took the chunk (its job cancelled) is not rendered: its slot
            # may be another stream's already. Its job hears nothing more, so an empty chunk stands in.
            live = [i for i, (stream, _, _) in enumerate(items) if not stream.closed]
            for i in live:
                items[i][0].rendering = True
        out = [RenderedChunk(audio=np.zeros(0, np.float32), mel=torch.zeros(1, 0, 0), flow_s=0.0, hift_s=0.0)
               for _ in items]
        try:
            for i, chunk in zip(live, self._render([items[i] for i in live]) if live else []):
                out[i] = chunk
        finally:
            with self._streams_lock:
                released = [items[i][0] for i in live if items[i][0].release_pending]
                for i in live:
                    items[i][0].rendering = items[i][0].release_pending = False
            for stream in released:  # closed during the render (or by its final chunk): its slot is free now
                self.slots.give_back(stream.slot)
        return out

    def _render(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]]) -> list[RenderedChunk]:
        started = time.perf_counter()
        news: list[torch.Tensor | None] = [None] * len(items)
        for finalize in (False, True):
            group = [i for i, (_, _, task) in enumerate(items) if task.finalize == finalize]
            if group:
                for i, new in zip(group, self._flow([items[i] for i in group], finalize)):
                    news[i] = new
        flow_s = _synchronized(self._device) - started
        out = []
        for (stream, _, task), new in zip(items, news):
            t0 = time.perf_counter()
            wav, _ = self.hift.inference(self.slots.staged(stream.slot, new), finalize=task.finalize)
            audio = wav[0, self.slots.emitted[stream.slot]:].float().cpu().numpy()
            out.append(RenderedChunk(audio=audio, mel=new, flow_s=flow_s, hift_s=time.perf_counter() - t0))
        # Every chunk made: only now does any stream move on (the render loop renders a failed call's
        # chunks again one by one, from the state they had).
        for (stream, _, task), chunk in zip(items, out):
            self.slots.commit(stream.slot, chunk.mel.size(2), chunk.audio.size)
            stream.finished = task.finalize
            if task.finalize:
                stream.close()
        return out

    def _flow(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
              finalize: bool) -> list[torch.Tensor]:
        """The official flow call of each item's chunk (prompt + tokens [0, token_end) re-rendered), all in
        one solve: rows right-padded to the longest and masked (tts_core/flow/sampler.py). Returns each
        item's new frames (1, 80, n) float32, from 2 x token_offset on."""
        flow, ratio = self.flow, self.flow.cfg.token_mel_ratio
        conditions = []
        for stream, tokens, task in items:
            if len(tokens) < task.token_end:
                raise ValueError(f"chunk {task.index} needs {task.token_end} tokens, {len(tokens)} exist")
            token = torch.tensor([list(tokens[:task.token_end])], dtype=torch.long, device=self._device)
            p = stream.prompt
            conditions.append(flow.condition(token, p.token, p.feat, p.embedding, finalize))
        frames = max(c.mu.size(2) for c in conditions)
        rows = len(conditions)
        mu = torch.zeros(rows, flow.cfg.output_size, frames, device=self._device, dtype=self.dtype)
        cond, mask = torch.zeros_like(mu), torch.zeros(rows, 1, frames, device=self._device, dtype=self.dtype)
        for row, c in enumerate(conditions):
            length = c.mu.size(2)
            mu[row, :, :length], cond[row, :, :length], mask[row, :, :length] = c.mu[0], c.cond[0], 1
        spks = torch.cat([c.spks for c in conditions])
        sampler = flow.decoder
        attn_mask = sampler.estimator.attention_mask(frames, not finalize, self._device)
        mel = sampler.solve(sampler.noise(frames, self.dtype), mu, mask, spks, cond, attn_mask)
        return [mel[row:row + 1, :, c.prompt_frames + ratio * task.token_offset:c.mu.size(2)]
                for row, (c, (_, _, task)) in enumerate(zip(conditions, items))]


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
