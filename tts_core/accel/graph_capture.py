"""Record one call into a CUDA graph the way every graph here is recorded (or a chain of calls,
one graph each: `capture_chain`).

The call first runs `warmup` times on a side stream, so lazy initialisation, allocator growth and
cuBLAS workspace creation happen outside the capture (they are not capturable), then once inside it.

Graphs replay with `graph.replay()` from any thread, with no lock between threads. A graph that
draws random numbers draws them from a generator registered with it at capture (`generator`) that
only one thread's replays use: a decoder's graphs share the decoder's, each HiFT graph has its own. The
process's default CUDA generator draws nothing in a graph, and torch skips the RNG prologue of a
replay whose generator increment is 0. So no two threads' replays touch one generator's offset at
once (in torch 2.11 a replay's prologue advances it without a lock, pytorch/pytorch#176754). A
lock around every launch did this before: under load one lane's graph launch held it for up to
85 ms while the decode thread waited (`bench/host_waits.py`).
"""

from __future__ import annotations

import contextlib
import ctypes
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

K = TypeVar("K")
G = TypeVar("G")

import torch
import torch.fx.experimental._config as fx_config

T = TypeVar("T")

# Warm-up runs before recording: the first compiles what a new shape needs (torch.compile'd
# regions), grows the allocator and makes the stream's cuBLAS workspace; a second did nothing more
# but cost as much again: on the H100 the flow's two passes over its 491 graphs took 30-38 s of a
# 62-77 s capture, recording one pass 15-19 s (bench/results/worker_start.json, "before").
WARMUP_RUNS = 1
COMPILE_LIMIT = 64  # compiles per compiled function during capture (see compiling_at_start_up)


@dataclass
class CaptureClock:
    """Where start-up capture time goes, summed over every capture in this process (the start-up
    report takes differences around each part): warm-up runs (torch.compile's compiling happens in
    the first of them: `compile_s`, dynamo and inductor together), recording, graphs recorded, and
    inductor's compiled-graph cache hits and misses (a warm cache: no misses)."""

    warmup_s: float = 0.0
    record_s: float = 0.0
    graphs: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    compiles: int = 0  # graphs dynamo compiled (each size specialization counts)

    @classmethod
    def now(cls) -> CaptureClock:
        """The totals so far, compiler figures included: zero while torch._dynamo is not imported
        (nothing compiled yet; importing it only to read its counters cost seconds of start-up)."""
        utils = sys.modules.get("torch._dynamo.utils")
        if utils is None:
            return cls(CLOCK.warmup_s, CLOCK.record_s, CLOCK.graphs)
        inductor = utils.counters["inductor"]
        return cls(CLOCK.warmup_s, CLOCK.record_s, CLOCK.graphs,
                   sum(utils.compilation_time_metrics.get("_compile.compile_inner", ()), 0.0),
                   inductor["fxgraph_cache_hit"], inductor["fxgraph_cache_miss"],
                   utils.counters["stats"]["unique_graphs"])

    def since(self, before: CaptureClock) -> dict:
        """What happened between `before` and this (a report's figures, seconds rounded)."""
        out = {}
        for f in fields(self):
            delta = getattr(self, f.name) - getattr(before, f.name)
            out[f.name] = round(delta, 2) if isinstance(delta, float) else delta
        return out


CLOCK = CaptureClock()  # warm-up/record totals; compiler figures are read from torch in `now`


def miss_worth_logging(misses: int, first: int = 10) -> bool:
    """Whether the `misses`-th call that found no captured graph of its shape (and ran eagerly, at several
    replays' cost) gets a log line: the first few, then every hundredth, so a steady miss shows without
    flooding the log."""
    return misses <= first or misses % 100 == 0


def charge(started: float, recording: float, graphs: int) -> None:
    """Add one capture to CLOCK: warm-up from `started` to `recording` (perf_counter; the warm-up's
    stream synchronized by then), recording from then to now."""
    CLOCK.warmup_s += recording - started
    CLOCK.record_s += time.perf_counter() - recording
    CLOCK.graphs += graphs


@contextlib.contextmanager
def compiling_at_start_up(compiling: bool = True) -> Iterator[None]:
    """Where graphs are captured: torch.compile'd regions (the flow estimator's modules, HiFT's
    stages) compile here and nowhere else (replays run no Python), a few size specializations per
    region shape each; dynamo's default limit (8 per function) is for code that may recompile
    forever while serving. Without duck shaping a row count that equals a channel count
    (2 x 32 rows = 64) is not specialized with it. `compiling` False (graphs of the eager modules):
    nothing, and torch._dynamo stays unimported before ready."""
    if not compiling:
        yield
        return
    limit = max(COMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit), fx_config.patch(use_duck_shape=False):
        yield


@torch.inference_mode()
def capture_graph(graph: torch.cuda.CUDAGraph, call: Callable[[], T], warmup: int, pool=None,
                  stream: torch.cuda.Stream | None = None, generator: torch.Generator | None = None) -> T:
    """Warm `call` up, record it into `graph` and return the call's outputs (the graph's static
    outputs). `stream`: the stream to warm up and capture on (default: a fresh one). cuBLAS keeps a
    workspace per (handle, stream) and a graph keeps the one it was captured with, so graphs that
    may run at the same time as each other must be captured on different streams. `generator`:
    the CUDA generator `call` draws from, if any (it must pass it to every random op)."""
    if generator is not None:
        graph.register_generator_state(generator)
    return capture_chain([graph], [call], warmup, pool, stream)[0]


_DRIVER: ctypes.CDLL | None = None


def upload(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream) -> bool:
    """Upload the instantiated graph to the device now (cuGraphUpload, on `stream`) rather than at its
    first replay, which otherwise pays it on the replaying thread: ~0.85 us a node on an H200 (a
    5,000-node graph's first replay 4.3 ms, 0.03 ms once uploaded; `bench/bench_graph_launch.py
    --lifecycle`). Every graph here is uploaded where it is captured, so the first call served after a
    start or a swap does not pay it. False where this torch cannot hand over the graph's executable
    (`raw_cuda_graph_exec`) or the driver refuses; the first replay then uploads it, as before."""
    global _DRIVER
    exec_handle = getattr(graph, "raw_cuda_graph_exec", None)
    if exec_handle is None:
        return False
    if _DRIVER is None:
        _DRIVER = ctypes.CDLL("libcuda.so.1")
        _DRIVER.cuGraphUpload.argtypes = (ctypes.c_void_p, ctypes.c_void_p)
    return _DRIVER.cuGraphUpload(ctypes.c_void_p(exec_handle()), ctypes.c_void_p(stream.cuda_stream)) == 0


@torch.inference_mode()
def capture_chain(graphs: Sequence[torch.cuda.CUDAGraph], calls: Sequence[Callable[[], T]], warmup: int, pool=None,
                  stream: torch.cuda.Stream | None = None) -> list[T]:
    """Like `capture_graph` for calls that run in order, each reading what the ones before it
    left, one graph each; returns each call's outputs. The chain warms up as a whole: a call warmed
    up on its own would leave the next one reading the warm-up's tensors instead of the graph's.
    The graphs share one memory pool (`pool`, or a new one) and must replay in the order given."""
    side = stream if stream is not None else torch.cuda.Stream()
    if pool is None and len(graphs) > 1:
        pool = torch.cuda.graph_pool_handle()
    started = time.perf_counter()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(side)
    side.synchronize()  # so the clock charges the warm-up's GPU time to the warm-up
    recording = time.perf_counter()
    outs = []
    for graph, call in zip(graphs, calls, strict=True):
        # Thread-local: only this thread's unsafe CUDA calls break the capture, not the serving
        # threads' syncs while the compiled graphs are captured beside them (the tts-compile thread).
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            outs.append(call())
        upload(graph, side)
    side.synchronize()  # the uploads are done before another stream replays the graphs
    charge(started, recording, len(graphs))
    return outs


def record_set(keys: Sequence[K], device: torch.device, compiling: bool,
               record: Callable[[K, object, torch.cuda.Stream], G], stop: Callable[[], bool]) -> dict[K, G] | None:
    """A set of graphs, one `record(key, memory pool, stream)` per key in order, in a memory pool and capture
    stream of the set's own (a render lane's set, captured beside the set it replays now, adopted at its swap
    point); `compiling`: the calls run torch.compile'd code (`compiling_at_start_up`). None if `stop()` ended
    it early."""
    pool = torch.cuda.graph_pool_handle()
    stream = torch.cuda.Stream(device)
    graphs = {}
    with compiling_at_start_up(compiling), torch.cuda.device(device), torch.cuda.stream(stream):
        for key in keys:
            if stop():
                return None
            graphs[key] = record(key, pool, stream)
    return graphs

