"""How the GPU benchmarks time things (METHOD.md: warm up, synchronize, repeat, take the median).

`replay_ms` is device time (CUDA events around back-to-back calls): what a call costs the GPU.
`wall_ms` is host wall time with the device synchronized around each call: what a caller waits.
`rewind`, where given, restores state a call advances (KV positions, stream progress) before each
round (replay) or once after the warm-up (wall).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def replay_ms(fn: Callable[[], object], iters: int = 50, rounds: int = 5,
              rewind: Callable[[], None] | None = None) -> float:
    """Median over rounds of the mean device time per call of `iters` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        if rewind is not None:
            rewind()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        per.append(start.elapsed_time(end) / iters)
    return statistics.median(per)


def wall_ms(fn: Callable[[], object], iters: int = 10, warmup: int = 2,
            rewind: Callable[[], None] | None = None) -> float:
    """Median host wall time of one call, the device synchronized before and after it."""
    for _ in range(warmup):
        fn()
    if rewind is not None:
        rewind()
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(out)
