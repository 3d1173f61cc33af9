"""Replay CosyVoice3's pooled DiT solve (tts_core/flow/dit_pool.py) from CUDA graphs, one per batch
bucket (rows, context frames, new frames).

Eagerly a solve launches ~4,400 kernels (22 blocks x 10 Euler steps x ~20 ops) and the host's launch
cost set its time: 273 ms for one stream's first chunk on the H100, ~1 s for a batched call
(docs/PERF_NOTES.md). `DiTContextPool.solve_tables` does only device work from index tables copied over
before it, so a bucket's whole solve records into one graph: padding rows read the pool's zero frame
and write its trash frame, padded context frames are masked out, padded new frames are neither seen
by real ones (the mask) nor kept (their writes go to the trash frame). A call takes the smallest
bucket it fits; one that fits none runs eagerly and is counted (`eager_calls`). One stream's first chunk
on the H100: DiT 273 ms eager, 44.5 ms replayed, 29 ms with the compiled blocks (load_cv3_h100.json).

Each render lane replays its own `DiTSolveGraphs` (own memory pool and capture stream: graphs of one
pool share scratch memory and must not run at once); the context pool itself is shared.

As CosyVoice2's flow (flow_pool_graphs.py): a lane is ready on graphs of the plain block code, then
the tts-compile thread records the same buckets with each block's work around its attention
torch.compile'd (`graph_regions`: the elementwise work fused into few kernels) into a set of their
own (`capture_set`), which the lane adopts at its swap point (RenderLane.adopt). In both sets the
attention with the pool's reads and writes is one Triton kernel a block and step (dit_attention.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import structlog
import torch

from tts_core.accel.buckets import SolveKey, smallest_solve_bucket, solve_keys_largest_first
from tts_core.accel.graph_capture import WARMUP_RUNS, capture_graph, miss_worth_logging, record_set
from tts_core.accel import dit_attention
from tts_core.flow.dit_pool import (DiTContextPool, DiTRegions, DiTRow, DiTTables, SolveIndex, post_attention,
                                    pre_attention, pooled_sdpa)

log = structlog.get_logger(__name__)


class _SolveGraph:
    def __init__(self, pool: DiTContextPool, rows: int, ctx_cap: int, new_cap: int, mempool,
                 stream: torch.cuda.Stream, regions: DiTRegions) -> None:
        cfg, dev = pool.est.cfg, pool.device
        # Static inputs: index tables (all padding rows while capturing: the warm-up and the recording
        # touch only the zero and trash frames, so a lane may capture while others serve).
        self.tables = DiTTables(pool.table([], rows, ctx_cap, new_cap).to(dev), rows, ctx_cap, new_cap)
        self.mu = torch.zeros(rows, cfg.mu_dim, new_cap, device=dev, dtype=pool.dtype)
        self.cond = torch.zeros(rows, cfg.mel_dim, new_cap, device=dev, dtype=pool.dtype)
        self.spks = torch.zeros(rows, cfg.spk_dim, device=dev, dtype=pool.dtype)
        self.graph = torch.cuda.CUDAGraph()
        self.out = capture_graph(self.graph,
                                 lambda: pool.solve_tables(self.tables, self.mu, self.cond, self.spks, regions),
                                 warmup=WARMUP_RUNS, pool=mempool, stream=stream)

    def replay(self, table: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """Copy a call's inputs in (zeros beyond its rows and frames) and replay; the graph's output
        (rows, 80, new_cap) float32, overwritten by the next replay."""
        self.tables.packed.copy_(table, non_blocking=True)
        r, n = mu.size(0), mu.size(2)
        for static, given in ((self.mu, mu), (self.cond, cond)):
            static.zero_()
            static[:r, :, :n].copy_(given)
        self.spks.zero_()
        self.spks[:r].copy_(spks)
        self.graph.replay()
        return self.out


def fused_attention(qkv: torch.Tensor, kv: torch.Tensor, index: SolveIndex, heads: int) -> torch.Tensor:
    """`pooled_sdpa` in one Triton kernel (tts_core/accel/dit_attention.py): the rotary applied as q and k
    load, the context read from the pool where it lies, the new keys and values written there."""
    return dit_attention.pooled_attention(qkv, index.cos, index.sin, kv, index.ctx, index.ctx_len, index.write,
                                          index.lengths, heads, index.chunk)


def graph_regions(compiled: bool) -> DiTRegions:
    """What a captured solve runs of each block: the attention as one kernel where Triton is there (else
    `pooled_sdpa`); `compiled`: the work before and after it torch.compile'd (inductor: ~30 kernels a block
    eagerly, most of them elementwise work around the matmuls; sizes symbolic from the start, no graph
    break allowed; compiled in a capture's warm-up, `DiTSolveGraphs.capture_set`, never on a request)."""
    attention = fused_attention if dit_attention.available() else pooled_sdpa
    if not compiled:
        return DiTRegions(attention=attention)
    return DiTRegions(torch.compile(pre_attention, fullgraph=True, dynamic=True),
                      torch.compile(post_attention, fullgraph=True, dynamic=True), attention)


class DiTSolveGraphs:
    """One render lane's captured DiT solves."""

    def __init__(self, pool: DiTContextPool) -> None:
        if pool.device.type != "cuda":
            raise RuntimeError("DiT solve graphs need the flow on a CUDA device")
        self.pool = pool
        # (rows, ctx_cap, new_cap) -> graph, replayed by the lane's thread; replaced whole by the lane
        # at its swap point with a set `capture_set` made on another thread.
        self.solve_graphs: dict[SolveKey, _SolveGraph] = {}
        self.keys: list[SolveKey] = []  # every bucket `capture` was asked for, largest first
        self.eager_calls = 0  # solves that fit no bucket (each costs the eager launch time)

    def capture(self, rows: Sequence[int], ctx_caps: Sequence[int], new_caps: Sequence[int]) -> float:
        """Capture every (rows, ctx_cap, new_cap) bucket with the plain block code; returns the seconds
        it took."""
        started = time.perf_counter()
        self.keys = solve_keys_largest_first(rows, ctx_caps, new_caps)
        self.solve_graphs = self._record(graph_regions(compiled=False), lambda: False)
        seconds = time.perf_counter() - started
        log.info("dit_graphs_captured", graphs=len(self.solve_graphs), rows=list(rows), ctx_caps=list(ctx_caps),
                 new_caps=list(new_caps), seconds=round(seconds, 2))
        return seconds

    def capture_set(self, regions: DiTRegions, stop: Callable[[], bool] = lambda: False
                    ) -> dict[SolveKey, _SolveGraph] | None:
        """Every bucket `capture` was asked for, with `regions`, as a set of their own; returned, not put in
        (the lane adopts it at its swap point). Any thread, while the lane replays the current set: the
        warm-ups and recordings touch only the pool's zero and trash frames. None if `stop()` ended it early."""
        return self._record(regions, stop)

    def _record(self, regions: DiTRegions, stop: Callable[[], bool]) -> dict[SolveKey, _SolveGraph] | None:
        """A graph per bucket of `keys` (largest first: the later ones reuse its blocks of the set's memory
        pool), in a memory pool and capture stream of the set's own; None if `stop()` ended it early."""
        return record_set(self.keys, self.pool.device, regions.pre is not pre_attention,
                          lambda key, mempool, stream: _SolveGraph(self.pool, *key, mempool, stream, regions), stop)

    def solve(self, rows: list[DiTRow], mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """`DiTContextPool.solve` (mel (B, 80, N) float32 for mu (B, 80, N)), replaying the smallest
        bucket the call fits."""
        b, n = len(rows), mu.size(2)
        c = max((len(r.context) for r in rows), default=0)
        graphs = self.solve_graphs  # one read
        key = smallest_solve_bucket(graphs, b, c, n)
        if key is None:
            self.eager_calls += 1
            if miss_worth_logging(self.eager_calls):  # a bucket miss costs ~10x a replay: say so
                log.warning("dit_solve_eager", rows=b, context=c, new=n, eager_calls=self.eager_calls)
            return self.pool.solve(rows, mu, cond, spks)
        table = self.pool.table(rows, *key)
        out = graphs[key].replay(table, mu, cond, spks)
        return out[:b, :, :n].clone()
