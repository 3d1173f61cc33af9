"""Render the due chunks of CosyVoice3 jobs: the DiT flow and the causal HiFT, streamed as the official
`CosyVoice3Model.token2wav` (tts_core/streaming/token2wav3.py is the one-request reference) without its
re-renders.

Per-stream state lives in preallocated slots, taken when a segment's rendering starts and given back
at its final chunk or when its job leaves: the mel so far and the samples emitted (`DiTSlots`), the
DiT keys/values of its kept frames (`DiTContextPool`, which also holds each voice's shared prompt
frames) and the vocoder's F0 and phase increments (`HiftWindows`). A chunk renders only its new
frames through the DiT (chunk-masked, from the kept frames: exact within the pool's window; the
final chunk too unless `official_final`, which re-renders it with full attention as the official
loop does) and runs the causal HiFT over a bounded window, emitting the samples past those already
sent: no cross-fade, no seam.

Same interface as `chunk_render.ChunkRenderer` (lanes, `stream`, `render`, `prepare`), so the
scheduler and render lanes serve both families. A render call's chunks go through the DiT in one
batched pooled solve (rows of different lengths and contexts), then through the vocoder in batched passes
(`HiftWindows.render_many`: one decode per group of equal windows). On CUDA each lane replays the solve
and the decodes from CUDA graphs of its own, captured at `prepare` (tts_core/accel/dit_graphs.py,
tts_core/accel/causal_hift_graphs.py); with `compile` the tts-compile thread then records the solves
again with each DiT block's elementwise work torch.compile'd, which the lane adopts at its swap point.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from tts_core.flow.dit_flow import DiTFlowModel
from tts_core.flow.dit_pool import DiTContextPool, DiTRow, frame_bytes, shared_prompt_frames
from tts_core.flow.model import FlowConditioning
from tts_core.hift.causal import CausalHiftGenerator
from tts_core.hift.causal_window import HiftWindows, WindowDecoder, decode_windows, final_window
from tts_core.accel.graph_swap import GraphSwap
from tts_core.runtime.chunk_render import FlowPoolSettings, RenderLane
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
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


@dataclass(frozen=True, eq=False)  # by identity: the pool keys a voice's shared frames by this object
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
        chunk = flow.cfg.estimator.static_chunk_size
        self.pool = DiTContextPool(flow.decoder, settings.stream_slots, -(-settings.context_frames // chunk) * chunk,
                                   settings.voice_slots * settings.voice_frames, self._device, self.dtype)
        self.vocoder = HiftWindows(hift, settings.stream_slots, flow.decoder.rand_noise.size(2), self._device)
        # Per render lane: the vocoder decode's CUDA graphs (tts_core.accel.causal_hift_graphs.CausalHiftGraphs,
        # captured for that lane's row counts and windows); a lane without any decodes eagerly.
        self.vocoder_graphs: dict[str, WindowDecoder] = {}
        self.lanes = {name: RenderLane(name, max_batch=max(settings.first_batches)) for name in self.first_lanes}
        self.lanes["later"] = RenderLane("later", max_batch=max(settings.batches))
        self._voices: dict[str, tuple[Voice, _VoicePrompt]] = {}
        self._voices_lock = threading.Lock()
        self._streams_lock = threading.Lock()  # DiTChunkStream.closed / .rendering
        self.time_gpu = False  # no CUDA events here: flow_s and hift_s are host times around synchronized work
        log.info("dit_stream_slots_allocated", stream_slots=settings.stream_slots,
                 gb=round(self.slots.mel.numel() * 4 / 2**30, 3), pool_gb=round(self.pool.nbytes / 2**30, 3),
                 context_frames=self.pool.stream_frames, voice_frames=self.pool.voice_capacity,
                 frame_mb=round(frame_bytes(flow.decoder.estimator, self.pool.steps,
                                            self.pool.kv.element_size()) / 2**20, 3))

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
                self._add_to_pool(prompt)
                if self._device.type == "cuda":
                    # Copied and rendered on this thread's stream; another lane may use it next.
                    torch.cuda.current_stream(self._device).synchronize()
                known = (voice, prompt)
                self._voices[voice.name] = known
            return known[1]

    def _add_to_pool(self, prompt: _VoicePrompt) -> None:
        """Render the voice's shared prompt frames into the pool, once per voice object."""
        cfg = self.flow.cfg
        frames = shared_prompt_frames(prompt.feat.size(1), prompt.token.size(1), cfg.token_mel_ratio,
                                      cfg.pre_lookahead_len, self.pool.chunk)
        if frames > self.pool.voice_frames_left:
            # Still exact: each stream then renders the whole prompt into its own slot (more work per first
            # chunk, and the prompt counts against the stream's window).
            log.warning("dit_voice_pool_full", voice_frames=frames, left=self.pool.voice_frames_left,
                        capacity=self.pool.voice_capacity)
            frames = 0
        c = self.flow.condition(prompt.token[:, :0], prompt.token, prompt.feat, prompt.embedding, True)
        self.pool.add_voice(prompt, frames, c.mu, c.cond, c.spks)

    def stream(self, voice: Voice, schedule: ChunkSchedule, generator: torch.Generator | None) -> DiTChunkStream:
        # `generator` is unused: CosyVoice3's flow and HiFT draw no random numbers (fixed noise buffers).
        prompt = self._prompt(voice)
        slot = self.slots.take()
        self.pool.start_stream(slot, prompt)
        self.vocoder.start(slot)
        return DiTChunkStream(self, slot, prompt)

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
        """The voices' prompts on the device and their shared frames in the pool; with `graphs` (CUDA),
        each lane's DiT solves captured as CUDA graphs over the buckets `solve_buckets` gives, and its
        vocoder decodes over the windows `vocoder_windows` gives (rows as the lane's solve buckets)."""
        started = time.perf_counter()
        for voice in voices:
            self._prompt(voice)
        report = {"flow_voices_s": time.perf_counter() - started,
                  "flow_pool_gb": (self.slots.mel.numel() * 4 + self.pool.nbytes) / 2**30}
        if not graphs or self._device.type != "cuda":
            return report
        from tts_core.accel.causal_hift_graphs import CausalHiftGraphs
        from tts_core.accel.dit_graphs import DiTSolveGraphs

        t0 = time.perf_counter()
        buckets = self.solve_buckets(schedule)
        rows = {name: self.settings.batches if name == "later" else self.settings.first_batches for name in self.lanes}
        for name, lane in self.lanes.items():
            lane.graphs = DiTSolveGraphs(self.pool)
            lane.graphs.capture(rows[name], *buckets["later" if name == "later" else "first"])
            # The compiled set replaces the lane's solves at its swap point (`capture_compiled`).
            lane.swap = GraphSwap((lane.graphs.solve_graphs, lane.hift_graphs), lane.name)
        report["flow_capture_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        windows = self.vocoder_windows(schedule, voices)
        for name in self.lanes:
            self.vocoder_graphs[name] = CausalHiftGraphs(self.hift, self._device)
            self.vocoder_graphs[name].capture(rows=rows[name], frames=windows.chunks,
                                              final_frames=windows.later_finals if name == "later" else
                                              windows.first_finals)
        report.update({"hift_capture_s": time.perf_counter() - t0,
                       "flow_graphs": sum(len(lane.graphs.solve_graphs) for lane in self.lanes.values()),
                       "flow_buckets": buckets, "hift_windows": windows.chunks,
                       "hift_final_windows": {"first": windows.first_finals, "later": windows.later_finals}})
        return report

    def solve_buckets(self, schedule: ChunkSchedule) -> dict[str, tuple[list[int], list[int]]]:
        """(context caps, new-frame caps) of the DiT solve graphs: "first" for a first chunk (context:
        its voice's shared frames; new: the prompt's unshared tail and the first hop), "later" for the
        rest (context: shared + own frames, in `context_buckets` steps up to the window; new: a hop, or
        a final hop with its lookahead, plus a chunk where the first hop is off the chunk grid).
        Frame counts rounded up to 8. Voices added after start-up whose calls fit none run eagerly."""
        ratio, chunk = self.flow.cfg.token_mel_ratio, self.pool.chunk
        extra = chunk if schedule.first_hop_tokens else 0
        shared, first_news = set(), set()
        with self._voices_lock:
            prompts = [prompt for _, prompt in self._voices.values()]
        for prompt in prompts:
            frames = self.pool.shared_frames(prompt)
            hop = ChunkPlanner(schedule, prompt.token.size(1)).next_hop
            shared.add(frames)
            first_news.add(_round8(prompt.feat.size(1) - frames + hop * ratio + extra))
        prefix = max(shared, default=0)
        own = self.pool.stream_frames
        step = -(-own // self.settings.context_buckets // chunk) * chunk
        later_ctx = sorted({prefix} | {min(prefix + own, prefix + step * k)
                                       for k in range(1, self.settings.context_buckets + 1)})
        later_new = sorted({_round8(schedule.max_hop_tokens * ratio + extra),
                            _round8((schedule.max_hop_tokens + schedule.lookahead_tokens) * ratio + extra)})
        return {"first": (sorted(shared) or [0], sorted(first_news) or later_new), "later": (later_ctx, later_new)}

    def capture_compiled(self, stop=lambda: False) -> dict:
        """On the tts-compile thread, while the lanes serve on the graphs `prepare` captured: with
        `compile`, each lane's DiT solves recorded again with each block's work around its attention
        torch.compile'd (`dit_graphs.graph_regions`), published lane by lane, first lanes first; each
        lane adopts its set at its next render call. The vocoder's graphs stay as captured. Returns the
        seconds and compile / warm-up / record split (`stop()` ends early)."""
        if not self.settings.compile or any(lane.graphs is None for lane in self.lanes.values()):
            return {}
        from tts_core.accel.dit_graphs import graph_regions
        from tts_core.accel.graph_capture import CaptureClock

        t0, clock = time.perf_counter(), CaptureClock.now()
        regions = graph_regions(compiled=True)
        for lane in [self.lanes[name] for name in self.first_lanes] + [self.lanes["later"]]:
            solves = lane.graphs.capture_set(regions, stop)
            if solves is None:
                break
            lane.swap.publish((solves, lane.hift_graphs))
        return {"flow": {"s": round(time.perf_counter() - t0, 2), **CaptureClock.now().since(clock)}}

    def has_deferred(self) -> bool:
        return False

    def capture_deferred(self, stop=lambda: False) -> None:
        """Nothing is deferred: `prepare` captures every bucket."""

    def vocoder_windows(self, schedule: ChunkSchedule, voices: Sequence[Voice]) -> VocoderWindows:
        """The decoder windows (mel frames, ascending) the schedule makes for these voices: what each lane's
        `CausalHiftGraphs.capture` needs. Non-final: a voice's prompt sets its first hop; past the first chunk
        a window is the chunk's new frames + a fixed reach (`decode_windows`), the same for every voice once
        the hop stops growing. Final (`final_window`): after k non-final chunks, every tail the LM may end
        with (at least the lookahead's tokens past the last hop, fewer than the next hop's and its lookahead;
        any count when the first chunk is the final one); the first lanes render k = 0, the later lane the rest;
        none shorter than a capturable window."""
        ratio, look = self.flow.cfg.token_mel_ratio, schedule.lookahead_tokens
        growths = 0 if schedule.hop_scale == 1 else math.ceil(math.log(schedule.max_hop_tokens / schedule.hop_tokens,
                                                                        schedule.hop_scale))
        chunks: set[int] = set()
        finals: dict[str, set[int]] = {"first": set(), "later": set()}
        for prompt_tokens in {len(voice.flow_prompt_speech_token) for voice in voices}:
            planner = ChunkPlanner(schedule, prompt_tokens)
            tasks = [planner.next_chunk(sys.maxsize, lm_finished=False) for _ in range(growths + 3)]
            ends = [ratio * (task.token_end - look) for task in tasks]
            chunks.update(decode_windows(self.hift, ends))
            for k, task in enumerate(tasks):  # the final chunk after k non-final ones (k = len(tasks): as the last)
                offset = task.token_offset
                tails = range(1, task.token_end - offset) if k == 0 else range(look, task.token_end - offset)
                finals["first" if k == 0 else "later"].update(
                    final_window(self.hift, ends[k - 1] if k else 0, ratio * (offset + tail)) for tail in tails)
        # A window must be longer than the decoder's look-ahead to be captured: the shortest final tails (an
        # utterance of a token or two) stay eager.
        shortest = self.hift.conv_pre_look_right + 2
        first, later = ([w for w in sorted(finals[kind]) if w >= shortest] for kind in ("first", "later"))
        return VocoderWindows(sorted(chunks), first, later)

    @torch.inference_mode()
    def render(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
               lane: str = "later") -> list[RenderedChunk]:
        """One chunk per item (stream, the segment's flow tokens so far, its task), in order. The flow
        renders the items' chunks in one batched call per attention kind (chunk-masked, and full for
        final chunks); the vocoder then renders them in batched passes (`HiftWindows.render_many`). A
        stream whose final chunk this is gives its slot back."""
        self.lanes[lane].adopt()  # the swap point: none of this lane's graphs is running
        with self._streams_lock:
            # A stream closed since its lane took the chunk (its job cancelled) is not rendered: its slot
            # may be another stream's already. Its job hears nothing more, so an empty chunk stands in.
            live = [i for i, (stream, _, _) in enumerate(items) if not stream.closed]
            for i in live:
                items[i][0].rendering = True
        out = [RenderedChunk(audio=np.zeros(0, np.float32), mel=torch.zeros(1, 0, 0), flow_s=0.0, hift_s=0.0)
               for _ in items]
        try:
            for i, chunk in zip(live, self._render([items[i] for i in live], lane) if live else []):
                out[i] = chunk
        finally:
            with self._streams_lock:
                released = [items[i][0] for i in live if items[i][0].release_pending]
                for i in live:
                    items[i][0].rendering = items[i][0].release_pending = False
            for stream in released:  # closed during the render (or by its final chunk): its slot is free now
                self.slots.give_back(stream.slot)
        return out

    def _render(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
                lane: str) -> list[RenderedChunk]:
        started = time.perf_counter()
        news: list[torch.Tensor | None] = [None] * len(items)
        rows: list[DiTRow | None] = [None] * len(items)
        official = self.settings.official_final
        pooled = [i for i, (_, _, task) in enumerate(items) if not (official and task.finalize)]
        if pooled:
            for i, new, row in zip(pooled, *self._pooled([items[i] for i in pooled], lane)):
                news[i], rows[i] = new, row
        final = [i for i in range(len(items)) if i not in pooled]
        if final:
            for i, new in zip(final, self._flow([items[i] for i in final], True)):
                news[i] = new
        flow_s = _synchronized(self._device) - started
        t0 = time.perf_counter()
        rendered = self.vocoder.render_many(
            [(stream.slot, self.slots.staged(stream.slot, new), self.slots.emitted[stream.slot], task.finalize)
             for (stream, _, task), new in zip(items, news)], graphs=self.vocoder_graphs.get(lane))
        # One copy to the host for the call's chunks (each .cpu() waits for the stream).
        flat = torch.cat([wav[0] for wav, _ in rendered]).float().cpu().numpy()
        audios = np.split(flat, np.cumsum([wav.size(1) for wav, _ in rendered])[:-1])
        f0_frames = [f0_known for _, f0_known in rendered]
        hift_s = time.perf_counter() - t0  # the call's batched vocoder, shared by its chunks (as CosyVoice2's)
        out = [RenderedChunk(audio=audio, mel=new, flow_s=flow_s, hift_s=hift_s) for audio, new in zip(audios, news)]
        # Every chunk made: only now does any stream move on (the render loop renders a failed call's
        # chunks again one by one, from the state they had).
        for (stream, _, task), chunk, row, f0_known in zip(items, out, rows, f0_frames):
            self.slots.commit(stream.slot, chunk.mel.size(2), chunk.audio.size)
            self.vocoder.commit(stream.slot, f0_known)
            if row is not None:
                before = self.pool.own[stream.slot]
                self.pool.advance(stream.slot, row)
                if before <= self.pool.stream_frames < self.pool.own[stream.slot]:
                    # From here on each chunk sees the voice prompt and the latest window of own frames only.
                    # The configured trade (flow_context_s), not a fault: info, like CosyVoice2's.
                    log.info("dit_context_slid", kept_frames=self.pool.stream_frames,
                             own_frames=self.pool.own[stream.slot])
            stream.finished = task.finalize
            if task.finalize:
                stream.close()
        return out

    def _flow(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
              finalize: bool) -> list[torch.Tensor]:
        """The official full-attention final call of each item (prompt + all its tokens re-rendered), all
        in one solve: rows right-padded to the longest and masked (tts_core/flow/sampler.py). Returns each
        item's new frames (1, 80, n) float32, from 2 x token_offset on. Only with `official_final`."""
        flow, ratio = self.flow, self.flow.cfg.token_mel_ratio
        conditions = [self._condition(stream, tokens, task) for stream, tokens, task in items]
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

    def _condition(self, stream: DiTChunkStream, tokens: Sequence[int], task: ChunkTask) -> FlowConditioning:
        if len(tokens) < task.token_end:
            raise ValueError(f"chunk {task.index} needs {task.token_end} tokens, {len(tokens)} exist")
        token = torch.tensor([list(tokens[:task.token_end])], dtype=torch.long, device=self._device)
        p = stream.prompt
        return self.flow.condition(token, p.token, p.feat, p.embedding, task.finalize)

    def _pooled(self, items: Sequence[tuple[DiTChunkStream, Sequence[int], ChunkTask]],
                lane: str) -> tuple[list[torch.Tensor], list[DiTRow]]:
        """Each item's chunk, chunk-masked, from its stream's kept frames (`DiTContextPool`): only the
        frames after the stream's last kept chunk go through the DiT, all items in one solve (rows
        right-padded; the lane's captured graph of the smallest bucket it fits, if any). Returns each
        item's new frames (1, 80, n) float32 and its pool row (kept frames become the stream's at
        `DiTContextPool.advance`)."""
        ratio = self.flow.cfg.token_mel_ratio
        conditions = [self._condition(stream, tokens, task) for stream, tokens, task in items]
        rows = [self.pool.row(stream.slot, c.mu.size(2), keep=not task.finalize)
                for (stream, _, task), c in zip(items, conditions)]
        n = max(r.end - r.start for r in rows)
        mu = torch.zeros(len(rows), self.flow.cfg.output_size, n, device=self._device, dtype=self.dtype)
        cond = torch.zeros_like(mu)
        for i, (r, c) in enumerate(zip(rows, conditions)):
            mu[i, :, :r.end - r.start], cond[i, :, :r.end - r.start] = c.mu[0, :, r.start:], c.cond[0, :, r.start:]
        graphs = self.lanes[lane].graphs
        solve = graphs.solve if graphs is not None else self.pool.solve
        mel = solve(rows, mu, cond, torch.cat([c.spks for c in conditions]))
        news = [mel[i:i + 1, :, c.prompt_frames + ratio * task.token_offset - r.start:r.end - r.start]
                for i, (r, c, (_, _, task)) in enumerate(zip(rows, conditions, items))]
        return news, rows


@dataclass(frozen=True)
class VocoderWindows:
    """Decoder window lengths (mel frames, ascending) a schedule makes (`DiTChunkRenderer.vocoder_windows`)."""

    chunks: list[int]  # non-final chunks' (every lane)
    first_finals: list[int]  # final chunks that are a segment's first (the first lanes)
    later_finals: list[int]  # final chunks after a first (the later lane)


def _round8(frames: int) -> int:
    return -(-frames // 8) * 8


def _synchronized(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
