"""Render the due chunks of many jobs at once: one batched pooled-flow call, then each job's own
vocoder (the scheduler's fast path; `Token2WavStream` is the one-request path).

Owns the flow's context pool (`tts_core.flow.pooled`: every frame computed once, exact up to
`FlowPoolSettings.context_frames` of a segment's own speech), the voices registered in it, and the
captured flow/HiFT graphs. Streams are opened on any thread (slot bookkeeping only); everything
that runs the model runs on a rendering thread, or at start-up in `prepare`.

Lanes render at once, each on its own thread and CUDA stream (`render_loop`): "first-<i>" lanes
render only the first chunks of new calls (small calls, prompt context only) and "later"
everything else (large batched calls). A graph cannot replay while it is already running, and
graphs captured into one memory pool share their scratch memory, so each lane replays graphs of
its own (own pool, own capture stream); the context pool is shared, and no two lanes touch the same
stream slot at the same time (a job is claimed by one lane per chunk, and its first chunk is handed
off before its later chunks are planned).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from tts_core.accel.graph_swap import GraphSwap
from tts_core.flow import FlowModel
from tts_core.flow.context_pool import PoolShape
from tts_core.flow.pooled import PooledFlow, PooledStream, VoicePrefix
from tts_core.hift import HiftGenerator
from tts_core.runtime.chunk_vocoder import ChunkVocoder, HiftGraphs, push_chunks
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
from tts_core.streaming.token2wav import RenderedChunk
from tts_core.voices import Voice

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class FlowPoolSettings:
    stream_slots: int  # streams rendering at once (one per job)
    context_frames: int = 700  # own mel frames a segment keeps exactly (14 s); beyond, its latest
    encoder_tokens: int | None = 50  # tokens the encoder re-reads before a chunk; None: all (exact)
    context_int8: bool = False  # kept block inputs as int8 + a scale a frame (PoolShape.int8): half the memory
    voice_frames: int = 500  # shared prompt frames a voice can hold (10 s prompts)
    voice_slots: int = 8  # voices the pool can hold (each voice_frames x ~0.57 MB in bf16)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)  # graph row buckets; also the largest call
    context_buckets: int = 4  # context-capacity graph buckets between the prompt and the maximum
    first_batches: tuple[int, ...] = (1, 2, 4, 8)  # graph row buckets of a first-chunk lane
    first_lanes: int = 3  # first-chunk lanes (each its own graphs); 0: "later" renders first chunks too
    compile: bool = False  # captured solves call a torch.compile'd estimator step (accel/flow_pool_graphs)
    compile_hift: bool = False  # captured HiFT graphs call torch.compile'd stages (accel/hift_graphs)
    solve_parts: int = 1  # graphs per captured solve (accel/flow_pool_graphs.PooledFlowGraphs.capture)
    # Before ready only each lane's largest solve bucket and no final-chunk HiFT shapes (the rest in `capture_compiled`)
    defer_later: bool = False
    # CosyVoice3 (runtime/dit_render.py): the final chunk as the official full-attention re-render of the
    # whole segment instead of chunk-masked from the pool (docs/PERF_NOTES.md, "CosyVoice3's final chunk")
    official_final: bool = False


@dataclass
class RenderLane:
    """What one rendering thread replays: its flow graphs and HiFT graphs (None/empty: eager)."""

    name: str
    graphs: object | None = None  # PooledFlowGraphs
    hift_graphs: HiftGraphs = field(default_factory=dict)
    max_batch: int = 1
    # Around each vocoder call, with ChunkRenderer.time_gpu: made once, recorded again each call
    # (making CUDA events under load stalls the host).
    timing_events: tuple | None = None
    # The lane's (flow solves, HiFT graphs) group, replaced whole by the compiled one that
    # `ChunkRenderer.capture_compiled` publishes (None: nothing will replace it).
    swap: GraphSwap | None = None

    def adopt(self) -> None:
        """The lane's swap point, at the start of each render call on its thread: none of its graphs
        is running then (its previous call waited for its stream), so a published group replaces
        the current one here and nowhere else."""
        if self.swap is not None and self.swap.pending:
            solves, self.hift_graphs = self.swap.take()
            self.graphs.solve_graphs = solves


@dataclass
class PooledChunkStream:
    """One job segment's state on the fast path: its pooled flow stream and its vocoder caches."""

    flow: PooledStream
    vocoder: ChunkVocoder
    schedule: ChunkSchedule
    renderer: ChunkRenderer
    finished: bool = False
    cuda_stream: object | None = None  # the CUDA stream its vocoder caches were last written on

    def close(self) -> None:
        """Give the flow slot back (idempotent; any thread)."""
        self.renderer.close(self)


class ChunkRenderer:
    def __init__(self, flow: FlowModel, hift: HiftGenerator, settings: FlowPoolSettings) -> None:
        self.flow, self.hift = flow, hift
        self.settings = settings
        chunk = flow.cfg.estimator.static_chunk_size
        frames = -(-settings.context_frames // chunk) * chunk
        voice_frames = -(-settings.voice_frames // chunk) * chunk
        shape = PoolShape(settings.stream_slots, frames, voice_slots=settings.voice_slots, voice_frames=voice_frames,
                          prompt_frames=voice_frames + 2 * chunk, int8=settings.context_int8)
        self.pooled = PooledFlow(flow, shape, settings.encoder_tokens)
        self.lanes = {name: RenderLane(name, max_batch=max(settings.first_batches)) for name in self.first_lanes}
        self.lanes["later"] = RenderLane("later", max_batch=max(settings.batches))
        self._voices: dict[str, tuple[Voice, VoicePrefix]] = {}
        self._slots = threading.Lock()  # streams open/close on the decode thread, finish on the render thread
        self._hift_dtype = next(hift.parameters()).dtype
        self._device = self.pooled.device
        # On CUDA each flow call reports its encoder's and solve's time on the lane's stream and each vocoder
        # call its host launch and stream time (RenderedChunk.flow_gpu_s, hift_gpu_s; a job's log line has its
        # first chunk's): CUDA events made once per lane and recorded again each call, a few microseconds. A
        # first chunk's render wall far above its stream time is the host's, not the GPU's.
        self.time_gpu = self._device.type == "cuda"
        log.info("flow_pool_allocated", gb=round(self.pooled.pool.nbytes() / 2**30, 2), stream_slots=shape.stream_slots,
                 context_frames=frames, encoder_tokens=settings.encoder_tokens, context_int8=shape.int8)

    @property
    def first_lanes(self) -> list[str]:
        return [f"first-{i}" for i in range(self.settings.first_lanes)]

    def voice(self, voice: Voice) -> VoicePrefix:
        known = self._voices.get(voice.name)
        if known is None or known[0] is not voice:
            with self._slots:
                prefix = self.pooled.register_voice(
                    torch.tensor([voice.flow_prompt_speech_token], dtype=torch.long),
                    voice.prompt_speech_feat[None], voice.flow_embedding[None])
            if self._device.type == "cuda":
                # Registered outside `prepare` (a voice added later): make its frames visible to the
                # rendering thread's stream before any stream of it renders.
                torch.cuda.current_stream(self._device).synchronize()
            known = (voice, prefix)
            self._voices[voice.name] = known
        return known[1]

    def stream(self, voice: Voice, schedule: ChunkSchedule, generator: torch.Generator | None) -> PooledChunkStream:
        prefix = self.voice(voice)
        with self._slots:
            flow_stream = self.pooled.open_stream(prefix)
        return PooledChunkStream(flow_stream, ChunkVocoder(self.hift, generator), schedule, self)

    def close(self, stream: PooledChunkStream) -> None:
        with self._slots:
            self.pooled.close_stream(stream.flow)

    def prepare(self, voices: Sequence[Voice], schedule: ChunkSchedule, graphs: bool) -> dict:
        """Register the voices (their shared prompt frames, once) and, with `graphs`, capture the
        flow and HiFT graphs the steady schedule uses (start-up). Returns the start-up report."""
        started = time.perf_counter()
        for voice in voices:
            self.voice(voice)
        report: dict = {"flow_voices_s": time.perf_counter() - started,
                        "flow_pool_gb": self.pooled.pool.nbytes() / 2**30}
        s, ratio, chunk = self.settings, self.flow.cfg.token_mel_ratio, self.pooled.chunk
        prefix = max((p.prefix_frames for _, p in self._voices.values()), default=0)
        # Per voice: its first two hops, the first padded as its ChunkPlanner pads it so that prompt + hop end on
        # a chunk, and its first call's shape (encoder tokens; new frames: the prompt's unshared tail + that hop).
        # A first hop off the chunk grid (`first_hop_tokens`) gives the second call a shape of its own too: its
        # window, frames and vocoder chunk are no later call's (a steady call renders the longest hop).
        voice_hops = [(p, _opening_hops(schedule, p.prompt_token.size(1))) for _, p in self._voices.values()]
        first_hops = {hops[0] * ratio for _, hops in voice_hops}
        first_shapes = {self.pooled.call_shape(p, hops[:1]) for p, hops in voice_hops}
        own_first_hop = schedule.first_hop_tokens is not None
        second_hops = sorted({hops[1] * ratio for _, hops in voice_hops}) if own_first_hop else []
        second_shapes = {self.pooled.call_shape(p, hops) for p, hops in voice_hops} if own_first_hop else set()
        # New frames per call: a voice's first call's, or a hop + lookahead (a final call); a first hop off
        # the chunk grid re-renders up to one chunk more next call.
        extra = chunk if schedule.first_hop_tokens else 0
        first_news = sorted({-(-(frames + extra) // 16) * 16 for _, frames in first_shapes})
        first_lanes = [self.lanes[name] for name in self.first_lanes]
        if not graphs:
            return report
        from tts_core.accel.flow_pool_graphs import PooledFlowGraphs, prepare_estimator
        from tts_core.accel.graph_capture import CaptureClock

        own_max = self.pooled.pool.shape.stream_frames
        step = -(-own_max // s.context_buckets // chunk) * chunk
        ctx_caps = sorted({prefix} | {min(prefix + own_max, prefix + step * k)
                                      for k in range(1, s.context_buckets + 1)})
        hop = schedule.max_hop_tokens * ratio
        new_caps = sorted(set(first_news) | {-(-(hop + schedule.lookahead_tokens * ratio + extra) // 16) * 16})
        window = None
        if s.encoder_tokens is not None:
            # Every non-final call of the default schedule reads a chunk-aligned window + a hop +
            # lookahead and renders a hop of frames (the first call too, for a 150-token prompt).
            window = s.encoder_tokens + schedule.max_hop_tokens + schedule.lookahead_tokens
        # A final call renders the tokens after the last commit: up to a hop + lookahead (+ one
        # encoder chunk when the first hop is off the chunk grid).
        final_tokens = range(1, schedule.max_hop_tokens + schedule.lookahead_tokens + extra // ratio + 1)
        later = self.lanes["later"]
        t0 = time.perf_counter()
        clock = CaptureClock.now()
        # Graphs of the eager modules first (no torch.compile tracing before ready); the compiled
        # ones are captured while serving (`capture_compiled`). The estimator is laid out for its
        # compiled form now, before any graph reads its weights.
        if s.compile:
            prepare_estimator(self.flow.decoder.estimator)
        later.graphs = PooledFlowGraphs(self.pooled, time_gpu=self.time_gpu)
        later.graphs.capture(s.batches, ctx_caps, new_caps, s.solve_parts, defer=s.defer_later)
        report["flow_later_s"] = time.perf_counter() - t0
        # First lanes: first calls only, whose context is exactly their voice's shared prefix. Like
        # the later lane, each only its largest bucket before ready (a first chunk padded to it
        # meanwhile); the rest come with the compiled set.
        for first in first_lanes:
            first.graphs = PooledFlowGraphs(self.pooled, time_gpu=self.time_gpu)
            first.graphs.capture(s.first_batches, sorted({p.prefix_frames for _, p in self._voices.values()}),
                                 first_news, s.solve_parts, defer=s.defer_later)
        report["flow_first_s"] = time.perf_counter() - t0 - report["flow_later_s"]
        # Each voice's first call, whatever its first hop: a first hop off the official one (or a prompt
        # whose tail spans another chunk) reads a window no later call reads.
        for first in first_lanes:
            for tokens, frames in sorted(first_shapes):
                first.graphs.capture_encoder(s.first_batches, tokens, frames, False)
        # Second calls render on the later lane, a few streams at a time: the first lanes' row buckets.
        for tokens, frames in sorted(second_shapes):
            later.graphs.capture_encoder(s.first_batches, tokens, frames, False)
        if window is not None:
            later.graphs.capture_encoder(s.batches, window, hop, False)
            for first in first_lanes:
                first.graphs.capture_encoder(s.first_batches, window, hop, False)
            # Final calls, one row each, by their uncommitted tokens u: the window starts a whole
            # number of encoder chunks before the last commit, so a final reads u + that many tokens
            # and renders u * ratio frames.
            token_chunk = self.pooled.token_chunk
            before = -(-s.encoder_tokens // token_chunk) * token_chunk
            for u in final_tokens:
                later.graphs.capture_encoder((1,), before + u, u * ratio, True)
        report["flow_capture_s"] = time.perf_counter() - t0
        report["flow_stages"] = {**CaptureClock.now().since(clock),
                                 "deferred": sum(len(lane.graphs.deferred) for lane in self.lanes.values())}
        t0 = time.perf_counter()
        clock = CaptureClock.now()
        self._hift_shapes = self._hift_lane_shapes(first_lanes, sorted(first_hops), second_hops, hop, final_tokens)
        # Before ready, without the later lane's final-chunk shapes (52 of its 74 graphs by default):
        # a final chunk runs its vocoder eagerly until the compiled set, which has them, is in.
        no_finals = set(self._hift_lane_shapes(first_lanes, sorted(first_hops), second_hops, hop, range(0))["later"])
        for lane in self.lanes.values():
            shapes = self._hift_shapes[lane.name]
            if s.defer_later and lane.name == "later":
                shapes = [k for k in shapes if k in no_finals]
            lane.hift_graphs = self._hift_graphs(shapes, None)
            lane.swap = GraphSwap((lane.graphs.solve_graphs, lane.hift_graphs), lane.name)
        report["hift_capture_s"] = time.perf_counter() - t0
        report["hift_stages"] = CaptureClock.now().since(clock)
        report.update({"flow_ctx_caps": ctx_caps, "flow_new_caps": new_caps, "flow_batches": list(s.batches),
                       "flow_first_batches": list(s.first_batches),
                       "first_lanes": len(first_lanes),
                       "flow_compiled": s.compile, "hift_compiled": s.compile_hift, "flow_solve_parts": s.solve_parts,
                       "flow_graphs": sum(len(lane.graphs.solve_graphs) for lane in self.lanes.values()),
                       "hift_graphs": sum(len(lane.hift_graphs) for lane in self.lanes.values())})
        return report

    def capture_compiled(self, stop=lambda: False) -> dict:
        """While the lanes serve on the graphs `prepare` captured (another thread): each lane's
        complete set, its flow solves with the compiled estimator (`compile`; and the buckets
        `defer_later` left out) and its HiFT with the compiled stages (`compile_hift`), published
        lane by lane, first lanes first (GraphSwap; each lane adopts it at its next render call).
        Returns per part its seconds and compile / warm-up / record split (`stop()` ends early)."""
        from tts_core.accel.flow_pool_graphs import compiled_estimator
        from tts_core.accel.graph_capture import CaptureClock
        from tts_core.accel.hift_graphs import compiled_mix

        s = self.settings
        estimator = compiled_estimator(self.flow.decoder.estimator) if s.compile else None
        mix = compiled_mix() if s.compile_hift else None
        report: dict = {"flow": {"s": 0.0}, "hift": {"s": 0.0}}
        for lane in [self.lanes[name] for name in self.first_lanes] + [self.lanes["later"]]:
            if stop():
                break
            t0, c0 = time.perf_counter(), CaptureClock.now()
            solves = lane.graphs.solve_graphs
            if s.compile or lane.graphs.deferred:
                solves = lane.graphs.capture_set(estimator, stop)
                if solves is None:
                    break
            t1, c1 = time.perf_counter(), CaptureClock.now()
            shapes = self._hift_shapes[lane.name]
            hift = (self._hift_graphs(shapes, mix) if s.compile_hift or set(shapes) != set(lane.hift_graphs)
                    else lane.hift_graphs)
            lane.swap.publish((solves, hift))
            for part, figures in (("flow", {"s": t1 - t0, **c1.since(c0)}),
                                  ("hift", {"s": time.perf_counter() - t1, **CaptureClock.now().since(c1)})):
                for key, value in figures.items():
                    report[part][key] = report[part].get(key, 0) + value
        return {part: {k: round(v, 2) for k, v in figures.items()} for part, figures in report.items()}

    def _hift_lane_shapes(self, first_lanes: list[RenderLane], first_hops: list[int], second_hops: list[int],
                          hop: int, final_tokens: range) -> dict[str, list[tuple[int, int, int]]]:
        """HiFT graph shapes (rows, frames incl. cache, cached samples) per lane: first chunks (no
        caches; "later" renders a later segment's first chunk); on "later", second chunks of their own
        length (after a first hop off the chunk grid) in the first lanes' row buckets, later chunks (8
        cached frames + a full hop) in every row bucket and final chunks (8 cached frames + a final
        call's frames) one row each, so no chunk of a steady schedule runs eagerly (a first chunk that
        is also the last, a short utterance, does)."""
        s, ratio = self.settings, self.flow.cfg.token_mel_ratio
        cached = 8 * 480
        finals = [(1, 8 + n * ratio, cached) for n in final_tokens]
        firsts_hift = [(rows, first_hop, 0) for first_hop in first_hops for rows in s.first_batches]
        seconds = [(rows, 8 + second, cached) for second in second_hops for rows in s.first_batches]
        steady = [(rows, 8 + hop, cached) for rows in s.batches]
        shapes = {lane.name: firsts_hift for lane in first_lanes}
        shapes["later"] = firsts_hift + seconds + steady + finals
        return shapes

    def _hift_graphs(self, shapes: list[tuple[int, int, int]], mix) -> HiftGraphs:
        """One lane's HiFT graphs, in a memory pool and capture stream of their own (a lane replays
        one at a time), with `mix` (compiled stages, or None: the eager ones)."""
        from tts_core.accel.hift_graphs import GraphedHift

        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self._device)
        graphs: HiftGraphs = {}
        with torch.cuda.device(self._device):
            for key in sorted(set(shapes), key=lambda k: k[0] * k[1], reverse=True):  # largest first: pool reuse
                rows, frames, cache = key
                graphs[key] = GraphedHift(self.hift, frames, cache, rows=rows, pool=pool, stream=stream, mix=mix)
        return graphs

    @property
    def dtype(self) -> torch.dtype:
        """The flow's dtype (HiFT runs in its own, float32)."""
        return self.pooled.dtype

    @property
    def max_batch(self) -> int:
        return self.lanes["later"].max_batch

    def render(self, items: Sequence[tuple[PooledChunkStream, Sequence[int], ChunkTask]],
               lane: str = "later") -> list[RenderedChunk]:
        """One chunk per item (stream, the segment's tokens so far, its task), in the same order,
        on the calling thread's `lane`. The flow time is the batched call's, shared by all items. A
        stream whose final chunk this is gives its flow slot back."""
        started = time.perf_counter()
        replays = self.lanes[lane]
        replays.adopt()
        streams = [s.flow for s, _, _ in items]
        tokens = [torch.tensor([list(t[:task.token_end])], dtype=torch.long) for _, t, task in items]
        finalize = [task.finalize for _, _, task in items]
        render = replays.graphs.render if replays.graphs is not None else self.pooled.render
        mels = render(streams, tokens, finalize)
        flow_done = _synchronized(self._device)
        flow_gpu = replays.graphs.gpu_split() if replays.graphs is not None else None
        return self._vocode([s for s, _, _ in items], mels, finalize, [flow_done - started] * len(items), flow_gpu,
                            replays)

    def _vocode(self, streams: Sequence[PooledChunkStream], mels: Sequence[torch.Tensor], finalize: Sequence[bool],
                flow_s: Sequence[float], flow_gpu: tuple[float, float] | None,
                replays: RenderLane) -> list[RenderedChunk]:
        """Each stream's vocoder on its chunk's mel, and the audio to the host."""
        here = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        for stream in streams:
            if here is not None and stream.cuda_stream is not None and stream.cuda_stream != here:
                # Its caches were made on the other lane's stream: the allocator must not hand their
                # memory back to that stream while this one still reads them.
                stream.vocoder.record_stream(here)
            stream.cuda_stream = here
        t0 = time.perf_counter()
        events = None
        if self.time_gpu and here is not None:
            if replays.timing_events is None:
                replays.timing_events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events = replays.timing_events
            events[0].record()
        wavs = push_chunks([s.vocoder for s in streams], [m.to(self._hift_dtype) for m in mels], finalize,
                           replays.hift_graphs)
        audio = [w[0].float() for w in wavs]
        joined = torch.cat(audio) if audio else None
        launched = time.perf_counter()
        if events is not None:
            events[1].record()
        host = joined.cpu().numpy() if joined is not None else np.zeros(0, np.float32)
        hift_s = time.perf_counter() - t0  # shared by the call's chunks, like the flow time
        # The copy above waited for the stream, so the events have completed.
        hift_gpu = None if events is None else (launched - t0, events[0].elapsed_time(events[1]) / 1e3)
        out, at = [], 0
        for stream, fin, mel, a, f in zip(streams, finalize, mels, audio, flow_s):
            stream.finished = fin
            if fin:
                stream.close()
            out.append(RenderedChunk(audio=np.ascontiguousarray(host[at:at + a.numel()]), mel=mel,
                                     flow_s=f, hift_s=hift_s, flow_gpu_s=flow_gpu, hift_gpu_s=hift_gpu))
            at += a.numel()
        return out


def _opening_hops(schedule: ChunkSchedule, prompt_tokens: int) -> tuple[int, int]:
    """A stream's first two hops (tokens) under `schedule` for a prompt of `prompt_tokens`, as its planner
    takes them."""
    planner = ChunkPlanner(schedule, prompt_tokens)
    first = planner.next_hop
    planner.next_chunk(planner.tokens_needed(), lm_finished=False)
    return first, planner.next_hop


def _synchronized(device: torch.device) -> float:
    """Wall time once this thread's stream is done (not the whole device: decode runs beside it)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return time.perf_counter()
