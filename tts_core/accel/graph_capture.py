"""Record one call into a CUDA graph the way every graph here is recorded.

The call first runs `warmup` times on a side stream, so lazy initialisation, allocator growth and
cuBLAS workspace creation happen outside the capture (they are not capturable), then once inside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


@torch.inference_mode()
def capture_graph(graph: torch.cuda.CUDAGraph, call: Callable[[], T], warmup: int, pool=None) -> T:
    """Warm `call` up, record it into `graph` and return the call's outputs (the graph's static outputs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            call()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph, pool=pool):
        return call()
