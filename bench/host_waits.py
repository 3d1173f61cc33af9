"""Where the host threads wait while they launch GPU work under load (a benchmark diagnostic).

A first chunk's vocoder call took 0.8 ms of host time to launch alone and 11 ms (p95 43 ms)
under load, while its kernels took 2.3 and 5.9 ms: the host, not the GPU, holds it. `HostWaits`
wraps the few places a launching thread can wait, per thread name, without changing what runs:
  launch_lock   acquiring the process-wide graph launch lock (tts_core/accel/graph_capture.py)
  graph_launch  CUDAGraph.replay itself (cudaGraphLaunch: host time grows with a graph's nodes)
  push_chunks   a render call's vocoder launches (graph input copies, replay, the caches' clones)
and the CUDA caching allocator's counters over the same stretch (a retried allocation frees
cached blocks, which synchronizes the device).
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch

ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class _TimedLock:
    """A lock that records how long each `with` waited to acquire it."""

    def __init__(self, lock, record: Callable[[float], None]) -> None:
        self._lock, self._record = lock, record

    def __enter__(self) -> None:
        t0 = time.perf_counter()
        self._lock.acquire()
        self._record(time.perf_counter() - t0)

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


class HostWaits:
    def __init__(self) -> None:
        self._seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []
        self._allocator: dict[str, int] = {}

    def _record(self, kind: str) -> Callable[[float], None]:
        def record(seconds: float) -> None:
            self._seconds[(kind, threading.current_thread().name)].append(seconds)
        return record

    def install(self) -> None:
        from tts_core.accel import graph_capture
        from tts_core.runtime import chunk_render

        lock = graph_capture._LAUNCH
        graph_capture._LAUNCH = _TimedLock(lock, self._record("launch_lock"))
        self._undo.append(lambda: setattr(graph_capture, "_LAUNCH", lock))

        replay, launched = torch.cuda.CUDAGraph.replay, self._record("graph_launch")

        def timed_replay(graph) -> None:
            t0 = time.perf_counter()
            replay(graph)
            launched(time.perf_counter() - t0)

        torch.cuda.CUDAGraph.replay = timed_replay
        self._undo.append(lambda: setattr(torch.cuda.CUDAGraph, "replay", replay))

        push, pushed = chunk_render.push_chunks, self._record("push_chunks")

        def timed_push(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return push(*args, **kwargs)
            finally:
                pushed(time.perf_counter() - t0)

        chunk_render.push_chunks = timed_push
        self._undo.append(lambda: setattr(chunk_render, "push_chunks", push))
        self.take()

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def take(self) -> dict:
        """Per kind and thread: calls, mean / p95 / max ms and the total; the allocator counters'
        change; since the last `take` (or `install`)."""
        seconds, self._seconds = self._seconds, defaultdict(list)
        out: dict = defaultdict(dict)
        for (kind, thread), values in sorted(seconds.items()):
            ms = 1e3 * np.array(values)
            out[kind][thread] = {"calls": len(values), "mean_ms": round(float(ms.mean()), 3),
                                 "p95_ms": round(float(np.percentile(ms, 95)), 3),
                                 "max_ms": round(float(ms.max()), 3), "total_ms": round(float(ms.sum()), 1)}
        if torch.cuda.is_available():
            stats = torch.cuda.memory_stats()
            now = {k: int(stats.get(k, 0)) for k in ALLOCATOR_COUNTERS}
            out["allocator"] = {k: v - self._allocator.get(k, 0) for k, v in now.items()}
            self._allocator = now
        return dict(out)
