"""Record one call into a CUDA graph the way every graph here is recorded, and replay graphs.

The call first runs `warmup` times on a side stream, so lazy initialisation, allocator growth and
cuBLAS workspace creation happen outside the capture (they are not capturable), then once inside it.

Replays go through `replay`, which launches one graph at a time in the process: the decode and the
render thread replay graphs concurrently, and in torch 2.11 a replay's prologue advances the shared
CUDA generator's offset without a lock (pytorch/pytorch#176754), so two concurrent replays of
graphs that draw random numbers (the decode sampler, HiFT's excitation) can race on it. The lock
covers only the launch (microseconds); the graphs still run concurrently on their streams.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch
import torch.fx.experimental._config as fx_config

T = TypeVar("T")

COMPILE_LIMIT = 64  # compiles per compiled function during capture (see compiling_at_start_up)


@contextlib.contextmanager
def compiling_at_start_up() -> Iterator[None]:
    """Where graphs are captured: torch.compile'd regions (the flow estimator's modules, HiFT's
    stages) compile here and nowhere else (replays run no Python), a few size specializations per
    region shape each; dynamo's default limit (8 per function) is for code that may recompile
    forever while serving. Without duck shaping a row count that equals a channel count
    (2 x 32 rows = 64) is not specialized with it."""
    limit = max(COMPILE_LIMIT, torch._dynamo.config.recompile_limit)
    with torch._dynamo.config.patch(recompile_limit=limit), fx_config.patch(use_duck_shape=False):
        yield


@torch.inference_mode()
def capture_graph(graph: torch.cuda.CUDAGraph, call: Callable[[], T], warmup: int, pool=None,
                  stream: torch.cuda.Stream | None = None) -> T:
    """Warm `call` up, record it into `graph` and return the call's outputs (the graph's static
    outputs). `stream`: the stream to warm up and capture on (default: a fresh one). cuBLAS keeps a
    workspace per (handle, stream) and a graph keeps the one it was captured with, so graphs that
    may run at the same time as each other must be captured on different streams."""
    side = stream if stream is not None else torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=pool, stream=side):
        return call()


_LAUNCH = threading.Lock()  # process-wide on purpose: the generator it protects is process-wide


def replay(graph: torch.cuda.CUDAGraph) -> None:
    with _LAUNCH:
        graph.replay()
