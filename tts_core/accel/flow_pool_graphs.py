"""Replay the pooled flow's batched calls from CUDA graphs: a graph per encoder shape bucket, and
per solve bucket a chain of graphs (the solve cut at Euler steps) launched a part or two ahead of
the GPU (see `capture`).

`tts_core.flow.pooled` makes a call's work a function of static shapes: (rows, context capacity,
new-frame capacity) for the 10-step solve, whose pool reads and writes are index tensors built on
the device from a per-row table, and (rows, tokens, new frames, finalize) for the encoder. Each
captured call serves every mix of streams that fits its bucket; unused rows are padding rows that
read nothing and write only to the pool's trash. Anything without a bucket runs eagerly.

Use (the rendering thread only):

    graphs = PooledFlowGraphs(pooled)      # or PooledFlowGraphs(pooled, compiled_estimator(...))
    graphs.capture(rows=(1, 4, 16, 32), ctx_caps=(300, 500, 850), new_caps=(56, 112), parts=10)  # start-up
    graphs.capture_encoder(rows=(...), tokens=103, new_frames=100, finalize=False)      # start-up
    mels = graphs.render(streams, tokens, finalize)                                      # per call
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import structlog
import torch
from torch import nn

from tts_core.accel import flow_attention
from tts_core.accel.buckets import smallest_solve_bucket, solve_keys_largest_first
from tts_core.accel.graph_capture import (
    WARMUP_RUNS,
    capture_chain,
    capture_graph,
    compiling_at_start_up,
    miss_worth_logging,
    record_set,
)
from tts_core.flow import token_encoder
from tts_core.flow.encoder_window import encode_grouped, encode_new_frames
from tts_core.flow.estimator import FlowEstimator, NhwcConv1d, Regions, SelfAttention
from tts_core.flow.model import FlowModel
from tts_core.flow.pooled import PooledFlow, PooledPlan, PooledStream, SolveParts
from tts_core.flow.pooled_block import SplitBlock, after_attention, before_attention, pooled_sdpa, whole_block

log = structlog.get_logger(__name__)


@contextmanager
def device_position_tables(tables: dict) -> Iterator[None]:
    """The encoder builds its relative-position table on the host and copies it over, which graph
    capture forbids; while capturing, serve each (length, width, device, dtype) table from `tables`
    (filled by the warm-up calls; its tensors must outlive the graph, which reads their memory)."""
    build = token_encoder.relative_position_table

    def cached(length: int, d_model: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (length, d_model, str(device), dtype)
        if key not in tables:
            tables[key] = build(length, d_model, device, dtype)
        return tables[key]

    token_encoder.relative_position_table = cached
    try:
        yield
    finally:
        token_encoder.relative_position_table = build


# A solve's next part is launched while the part before it runs, so the GPU never waits for the
# host, and no further: what is queued stays a part or two, not the whole solve. H100 at 20 req/s,
# one start-up: 1, 2 and 3 ahead gave p95 first chunk 280.8, 279.9 and 282.7 ms, one stream p50
# 68.8-69.1 ms (docs/PERF_NOTES.md): the cut is what matters.
PARTS_AHEAD = 2


def _run_resnet(resnet: nn.Module, h: torch.Tensor, time_bias: torch.Tensor, first, second) -> torch.Tensor:
    return resnet(h, None, time_bias, first, second)


def prepare_estimator(estimator: FlowEstimator) -> None:
    """Before any graph of the estimator is captured, eager or compiled: its attention projections
    stacked and its convolutions' weights kept channels-last (`NhwcConv1d`: cuDNN runs 2 kernels
    each instead of 5), for the compiled and the eager calls alike. Once: doing it again would
    replace weights that graphs captured before read (a compiled set is captured while the eager
    one serves)."""
    for module in estimator.modules():
        if isinstance(module, SelfAttention):
            module.stack_projections()
        elif isinstance(module, NhwcConv1d) and module.weight_nhwc is None:
            module.keep_weight_channels_last()


def compiled_estimator(estimator: FlowEstimator) -> Callable:
    """The estimator step with its resnets and transformer blocks fused by torch.compile (inductor):
    ~1000 small kernels a step eagerly (bench/count_flow_ops.py), most of them elementwise work
    around the matmuls. Compiled per module, not per step: each module gets only its own layers'
    share of the pool as inputs (`estimator.Regions`), so all 56 blocks share one compiled graph on
    each side of their attention and the 14 resnets one per input width, and start-up compiles small
    graphs a few times (once per size specialization: one row, more rows) instead of the whole
    ~1000-op step 5-7 times (that did not finish capturing in 9.5 minutes on the H100). Sizes are
    symbolic from the start. A block's attention runs between its two compiled halves
    (`pooled_block.SplitBlock`; one stream's calls keep the block whole): one Triton kernel where Triton
    is (accel/flow_attention.py), else SDPA with the call's mask. All of it happens in a capture's
    warm-up (`PooledFlowGraphs.capture_set`, beside serving), none on a request; the compiled code only
    ever runs inside graph capture. `prepare_estimator` first."""
    prepare_estimator(estimator)
    cfg = estimator.cfg
    attention = pooled_sdpa
    if flow_attention.available() and next(estimator.parameters()).is_cuda:
        attention = functools.partial(_kernel_attention, chunk=cfg.static_chunk_size,
                                      left_chunks=cfg.num_decoding_left_chunks)
    # fullgraph: a graph break fails the capture loudly.
    before, after, whole = (torch.compile(f, fullgraph=True, dynamic=True)
                            for f in (before_attention, after_attention, whole_block))
    block = SplitBlock(before=before, attention=attention, after=after, whole=whole)
    regions = Regions(block=block, resnet=torch.compile(_run_resnet, fullgraph=True, dynamic=True))
    return functools.partial(estimator, regions=regions)


def _kernel_attention(qkv: torch.Tensor, ctx_kv: torch.Tensor, attn_mask: torch.Tensor, index, heads: int,
                      chunk: int, left_chunks: int) -> torch.Tensor:
    """`pooled_sdpa` as one kernel: the chunk-causal rule from the call's positions, not its mask."""
    return flow_attention.pooled_flow_attention(qkv, ctx_kv, index.key_pos, index.new_pos, index.ctx_count, heads,
                                                chunk, left_chunks)


class _SolveGraph:
    """One solve bucket's graphs: the 10 Euler steps cut into `parts` graphs (`SolveParts`),
    launched at most `ahead` parts ahead of the GPU."""

    def __init__(self, pooled: PooledFlow, rows: int, ctx_cap: int, new_cap: int, pool, stream,
                 estimator: Callable | None, parts: int) -> None:
        mel = pooled.model.cfg.output_size
        self.table = torch.tensor([pooled.padding_row()] * rows, dtype=torch.long, device=pooled.device)
        self.mu = torch.zeros(rows, mel, new_cap, device=pooled.device, dtype=pooled.dtype)
        solve = SolveParts(pooled.model, pooled.pool, self.table, self.mu, ctx_cap, pooled.steps, estimator, parts)
        self.graphs = [torch.cuda.CUDAGraph() for _ in range(parts)]
        self.out = capture_chain(self.graphs, [functools.partial(solve.run, k) for k in range(parts)],
                                 warmup=WARMUP_RUNS, pool=pool, stream=stream)[-1]
        self._done = [torch.cuda.Event() for _ in range(parts)]  # recorded again each replay

    def replay(self, table: torch.Tensor, mu: torch.Tensor, ahead: int) -> torch.Tensor:
        """Launch the solve; part k only once part k - `ahead` is done (the host waits, with the
        GIL released, in an event's synchronize rather than in a launch)."""
        self.table.copy_(table)
        self.mu.copy_(mu)
        last = len(self.graphs) - 1
        for k, graph in enumerate(self.graphs):
            if k >= ahead:
                self._done[k - ahead].synchronize()
            graph.replay()
            if k + ahead <= last:
                self._done[k].record()
        return self.out


class _EncodeGraph:
    def __init__(self, model: FlowModel, rows: int, tokens: int, new_frames: int, finalize: bool, pool,
                 stream) -> None:
        self.tokens = torch.zeros(rows, tokens, dtype=torch.long, device=model.input_embedding.weight.device)
        self.graph = torch.cuda.CUDAGraph()
        self._tables: dict = {}  # position tables the graph reads: must live as long as it
        with device_position_tables(self._tables):
            self.out = capture_graph(self.graph, lambda: encode_new_frames(model, self.tokens, finalize, new_frames),
                                     warmup=WARMUP_RUNS, pool=pool, stream=stream)

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens[:tokens.size(0)].copy_(tokens)
        self.graph.replay()
        return self.out[:tokens.size(0)]


class PooledFlowGraphs:
    def __init__(self, pooled: PooledFlow, estimator: Callable | None = None,
                 stream: torch.cuda.Stream | None = None, time_gpu: bool = False) -> None:
        """`estimator`: what the captured solves call per Euler step (default the model's own; or
        `compiled_estimator(...)`, which lanes may share). `stream`: the capture stream (default a
        new one). `time_gpu`: see below."""
        self.pooled = pooled
        self.estimator = estimator
        # (rows, ctx_cap, new_cap) -> graphs, replayed by the lane's thread. Replaced whole, never
        # changed in place, once that thread may read it: by the lane at its swap point with a set
        # `capture_set` made on another thread (runtime.chunk_render.RenderLane.adopt).
        self.solve_graphs: dict[tuple[int, int, int], _SolveGraph] = {}
        self.keys: list[tuple[int, int, int]] = []  # every bucket `capture` was asked for, largest first
        self.deferred: list[tuple[int, int, int]] = []  # of those, what `capture(defer=True)` left out
        self._parts = 1
        self.encode_graphs: dict[tuple[int, int, int, bool], _EncodeGraph] = {}  # (rows, tokens, new, final)
        self._pool = None
        self._stream = stream  # the capture stream of all these graphs (see graph_capture)
        self.eager_calls = 0  # solves that found no bucket (counted: each costs ~10x a replay)
        self.eager_encodes = 0  # encoder calls that found no graph
        # With `time_gpu` (the runtime's lanes on CUDA: ChunkRenderer.time_gpu), each render records CUDA events
        # around its encoder and solve work; `gpu_split()` reads them once the caller has synchronized. A lane
        # keeps this object when its compiled solves are swapped in (RenderLane.adopt), so it is set once here.
        self.time_gpu = time_gpu
        self._timing_events: tuple[torch.cuda.Event, ...] | None = None
        # A solve's parts launched ahead of the GPU (see `capture`); read at each render.
        self.parts_ahead = PARTS_AHEAD

    def _graph_pool(self):
        if self.pooled.device.type != "cuda":
            raise RuntimeError("pooled flow graphs need the model on a CUDA device")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.pooled.device)
        return self._pool

    def capture(self, rows: Sequence[int], ctx_caps: Sequence[int], new_caps: Sequence[int],
                parts: int = 1, defer: bool = False) -> float:
        """Capture the solve for every (rows, ctx_cap, new_cap); returns the seconds it took.
        `defer`: capture only the largest bucket now, which every call fits (padded: correct, at
        more GPU work), and leave the rest to `capture_set` (after the engine is ready).
        `parts`: graphs per solve, cut at Euler-step boundaries, launched `parts_ahead` ahead of
        the GPU. H100 under load (bench/host_waits.py): a whole 10-step solve's launch held its
        thread for 10 ms (first lanes) to 55 ms (the later lane) on average, up to 127 ms, also
        with its stream drained first, so the launch itself waits, it seems until enough of the
        graph has run; and the decode thread's event records stalled meanwhile (90 % of their
        stalled time fell inside such launches). Cut into ten, a launch takes under 1 ms (p95)
        and the decode thread hardly stalls."""
        started = time.perf_counter()
        pool = self._graph_pool()
        self._parts = parts
        # Largest first: later captures reuse its blocks of the shared graph memory pool. The
        # largest holds the most rows, context and new frames of all (max of each), so it fits all.
        keys = solve_keys_largest_first(rows, ctx_caps, new_caps)
        self.keys = keys
        keys = [k for k in keys if k not in self.solve_graphs]
        if defer:
            largest = (max(rows), max(ctx_caps), max(new_caps))
            keys, self.deferred = [k for k in keys if k == largest], [k for k in keys if k != largest]
        with compiling_at_start_up(self.estimator is not None):
            for key in keys:
                self.solve_graphs[key] = _SolveGraph(self.pooled, *key, pool, self._stream, self.estimator, parts)
        seconds = time.perf_counter() - started
        log.info("flow_pool_graphs_captured", graphs=len(self.solve_graphs), rows=list(rows), ctx_caps=list(ctx_caps),
                 new_caps=list(new_caps), parts=parts, deferred=len(self.deferred), seconds=round(seconds, 2))
        return seconds

    def capture_set(self, estimator: Callable | None,
                    stop: Callable[[], bool] = lambda: False) -> dict[tuple[int, int, int], _SolveGraph] | None:
        """Every bucket `capture` was asked for (the deferred ones too), with `estimator`, into a
        memory pool and capture stream of their own; returned, not put in: the lane's thread
        replaces `solve_graphs` with it at its swap point. Any thread, while the lane replays the
        current set: recording launches nothing; the warm-up runs write only padding rows (the
        pool's trash); capture errors are this thread's own (thread-local capture mode), so the
        serving threads' host syncs meanwhile are allowed. None if `stop()` ended it early."""
        return record_set(self.keys, self.pooled.device, estimator is not None,
                          lambda key, pool, stream: _SolveGraph(self.pooled, *key, pool, stream, estimator, self._parts),
                          stop)

    def capture_encoder(self, rows: Sequence[int], tokens: int, new_frames: int, finalize: bool) -> None:
        pool = self._graph_pool()
        for r in sorted(rows, reverse=True):
            key = (r, tokens, new_frames, finalize)
            if key not in self.encode_graphs:
                self.encode_graphs[key] = _EncodeGraph(self.pooled.model, r, tokens, new_frames, finalize, pool,
                                                       self._stream)

    @property
    def max_rows(self) -> int:
        return max((k[0] for k in self.solve_graphs), default=0)  # the largest bucket is captured first

    @torch.inference_mode()
    def render(self, streams: Sequence[PooledStream], tokens: Sequence[torch.Tensor],
               finalize: Sequence[bool]) -> list[torch.Tensor]:
        """Like `PooledFlow.render`, replaying captured graphs where a bucket fits; calls of more
        streams than the largest bucket are split."""
        pooled = self.pooled
        if self.time_gpu and self._timing_events is None:
            # Made once and recorded again each render: making CUDA events under load stalls the host.
            self._timing_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        events = self._timing_events if self.time_gpu else None
        if events:
            events[0].record()
        plans = [pooled.plan(s, t, f) for s, t, f in zip(streams, tokens, finalize)]
        mus = self.encode(plans)
        if events:
            events[1].record()
        largest = self.max_rows or len(plans)
        out: list[torch.Tensor] = []
        for a in range(0, len(plans), largest):
            part = plans[a:a + largest]
            mel = self._solve(part, mus[a:a + largest])
            out += [pooled.finish(s, p, mel[i:i + 1, :, :p.new_frames].clone())
                    for i, (s, p) in enumerate(zip(streams[a:a + largest], part))]
        if events:
            events[2].record()
        return out

    def gpu_split(self) -> tuple[float, float] | None:
        """(encoder, solve) seconds of stream time of the last render, after the caller synchronized
        its stream; None without `time_gpu`."""
        if not self.time_gpu or self._timing_events is None:
            return None
        start, encoded, solved = self._timing_events
        return start.elapsed_time(encoded) / 1e3, encoded.elapsed_time(solved) / 1e3

    def encode(self, plans: Sequence[PooledPlan]) -> list[torch.Tensor]:
        """Each plan's encoder output (mu), replaying a captured encoder graph where one fits."""
        return encode_grouped(self.pooled.model, plans, self._encode)

    def _encode(self, model: FlowModel, enc_tokens: torch.Tensor, fin: bool, new_frames: int) -> torch.Tensor:
        rows, n = enc_tokens.shape
        sizes = sorted(k[0] for k in self.encode_graphs if k[1:] == (n, new_frames, fin))
        if not sizes:
            self.eager_encodes += 1
            if miss_worth_logging(self.eager_encodes):  # ~10x a replay: say which shape
                log.warning("flow_encode_eager", rows=rows, tokens=n, frames=new_frames, final=fin,
                            eager_encodes=self.eager_encodes)
            return encode_new_frames(model, enc_tokens, fin, new_frames)
        fits = [r for r in sizes if r >= rows]
        if fits:
            return self.encode_graphs[(fits[0], n, new_frames, fin)].replay(enc_tokens).clone()
        # More rows of one shape than its largest graph: final calls are captured for one row, and
        # streams that end with as many uncommitted tokens share a call. Replays in pieces cost far
        # less than an eager encoder (on the H100, 64-113 of a later lane's calls per 30 s ran
        # eagerly at 16-19 req/s before).
        graph = self.encode_graphs[(sizes[-1], n, new_frames, fin)]
        return torch.cat([graph.replay(enc_tokens[a:a + sizes[-1]]).clone() for a in range(0, rows, sizes[-1])])

    def _solve(self, plans: Sequence[PooledPlan], mus: Sequence[torch.Tensor]) -> torch.Tensor:
        pooled = self.pooled
        rows = len(plans)
        ctx = max(p.ctx_frames for p in plans)
        new = max(p.new_frames for p in plans)
        graphs = self.solve_graphs  # one read
        key = smallest_solve_bucket(graphs, rows, ctx, new)
        if key is None:
            self.eager_calls += 1
            if miss_worth_logging(self.eager_calls):
                log.warning("flow_solve_eager", rows=rows, context=ctx, new=new, eager_calls=self.eager_calls)
            return pooled.solve(plans, mus)
        table = pooled.table([p.row for p in plans] + [pooled.padding_row()] * (key[0] - rows))
        return graphs[key].replay(table, pooled.stack_mu(mus, key[0], key[2]), self.parts_ahead)
