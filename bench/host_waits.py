"""Where the host threads wait while they launch GPU work under load (a benchmark diagnostic).

A first chunk's vocoder call took 0.8 ms of host time to launch alone and 11 ms (p95 43 ms)
under load, while its kernels took 2.3 and 5.9 ms: the host, not the GPU, holds it. `HostWaits`
wraps the few places a launching thread can wait, per thread name, without changing what runs:
  graph_launch  CUDAGraph.replay (cudaGraphLaunch; before 41c260d also a process-wide lock
                around it, timed then as `launch_lock`)
  push_chunks   a render call's vocoder launches (graph input copies, replay, the caches' clones)
  solve_replay, encode_replay, hift_replay   a flow solve's, a flow encoder's or a vocoder's
                graph replay with its input copies (which graph family a long launch is)
  cat, Tensor.to, Tensor.clone, Tensor.copy_, Event.record, Event.query   each call of these small
                ops, in every thread
and the CUDA caching allocator's counters over the same stretch (a retried allocation frees
cached blocks, which synchronizes the device). A probe thread sleeps 0.5 ms at a time and records
how late it wakes (`gil_probe`): a thread coming back from a call that let the GIL go (every
torch op, graph replay and stream wait does) waits about as long for it. `cpu` is the CPU time
the process's threads took over the stretch, in cores: the Python threads by name, the rest
(torch's CPU thread pools, the CUDA driver's threads) together.

Which thread holds up which: each call of STALL_S or more is kept as an interval, and `stalls`
says, per thread, how much of its stalled time fell while another thread was itself inside a long
call, by that call's kind. The CUDA driver serializes some of its work per context; a launch
that waits there (for room in a busy stream's queue) would show as the others' stalls lining up
with it.

`paced_threads` (a diagnostic, off by default): threads by name whose graph replays wait for their
CUDA stream to drain before and after each launch (outside the timed part), so that each launch
finds its stream empty and nothing queues behind it: whether the long launches come from the
launching stream's own backlog.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import torch
from gpu_trace import overlap_length, union_of

PROBE_SLEEP_S = 0.0005
STALL_S = 0.005
ALLOCATOR_COUNTERS = ("num_alloc_retries", "num_sync_all_streams", "num_device_alloc", "num_device_free")


class HostWaits:
    def __init__(self) -> None:
        self._seconds: dict[tuple[str, str], list[float]] = defaultdict(list)
        self._undo: list[Callable[[], None]] = []
        self._allocator: dict[str, int] = {}
        self._cpu: tuple[float, dict[int, float]] = (time.perf_counter(), _thread_cpu_s())
        self._probing = threading.Event()
        self._stalls: list[tuple[str, str, float, float]] = []  # (kind, thread, start, end) of calls >= STALL_S
        self.paced_threads: frozenset[str] = frozenset()

    def _probe(self) -> None:
        record = self._record("gil_probe")
        while self._probing.is_set():
            t0 = time.perf_counter()
            time.sleep(PROBE_SLEEP_S)
            record(time.perf_counter() - t0 - PROBE_SLEEP_S)

    def _record(self, kind: str) -> Callable[[float], None]:
        def record(seconds: float) -> None:
            self._seconds[(kind, threading.current_thread().name)].append(seconds)
        return record

    def _record_call(self, kind: str) -> Callable[[float, float], None]:
        """Like `_record`, from a call's start and end; a long call is also kept as an interval."""
        record = self._record(kind)

        def record_call(start: float, end: float) -> None:
            record(end - start)
            if end - start >= STALL_S:
                self._stalls.append((kind, threading.current_thread().name, start, end))
        return record_call

    def _time(self, owner: object, name: str, kind: str, paced: bool = False) -> None:
        """Wrap `owner.name` (a function or method) so that each call's host time is recorded as
        `kind`; with `paced`, the threads in `paced_threads` drain their stream around it."""
        original, record = getattr(owner, name), self._record_call(kind)

        def timed(*args, **kwargs):
            pace = paced and threading.current_thread().name in self.paced_threads
            if pace:
                torch.cuda.current_stream().synchronize()
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                record(t0, time.perf_counter())
                if pace:
                    torch.cuda.current_stream().synchronize()

        setattr(owner, name, timed)
        self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> None:
        from tts_core.accel import flow_pool_graphs, hift_graphs
        from tts_core.runtime import chunk_render

        self._time(torch.cuda.CUDAGraph, "replay", "graph_launch", paced=True)
        self._time(chunk_render, "push_chunks", "push_chunks")
        for owner, name, kind in ((flow_pool_graphs._SolveGraph, "replay", "solve_replay"),
                                  (flow_pool_graphs._EncodeGraph, "replay", "encode_replay"),
                                  (hift_graphs.GraphedHift, "inference", "hift_replay")):
            self._time(owner, name, kind)
        # The small ops around a render call's vocoder launches (each allocates and launches one
        # kernel or copy), and the decode thread's copies, event records and queries per step.
        for owner, name in ((torch, "cat"), (torch.Tensor, "to"), (torch.Tensor, "clone"), (torch.Tensor, "copy_"),
                            (torch.cuda.Event, "record"), (torch.cuda.Event, "query")):
            self._time(owner, name, f"{getattr(owner, '__name__', owner)}.{name}".removeprefix("torch."))
        self._probing.set()
        probe = threading.Thread(target=self._probe, name="bench-gil-probe", daemon=True)
        probe.start()
        self._undo.append(lambda: (self._probing.clear(), probe.join()))
        self.take()

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def take(self) -> dict:
        """Per kind and thread: calls, mean / p95 / max ms and the total; the allocator counters'
        change; since the last `take` (or `install`)."""
        seconds, self._seconds = self._seconds, defaultdict(list)
        stalls, self._stalls = self._stalls, []
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
        (then, before), now_s, after = self._cpu, time.perf_counter(), _thread_cpu_s()
        self._cpu = (now_s, after)
        names = {t.native_id: t.name for t in threading.enumerate()}
        cores: dict[str, float] = defaultdict(float)
        for tid, seconds in after.items():
            cores[names.get(tid, "other")] += (seconds - before.get(tid, 0.0)) / (now_s - then)
        out["cpu"] = {"process_cores": round(sum(cores.values()), 2),
                      "threads": {name: round(c, 2) for name, c in sorted(cores.items(), key=lambda kv: -kv[1])},
                      "other_threads": sum(1 for tid in after if tid not in names)}
        out["stalls"] = stall_overlap(stalls)
        return dict(out)


HOLDING = ("push_chunks", "solve_replay", "encode_replay", "hift_replay")  # kinds that hold other timed calls


def stall_overlap(stalls: list[tuple[str, str, float, float]]) -> dict:
    """Per thread: its stalled time in ms (the union of its long calls, without the kinds that hold
    other timed calls), and the fraction of it during which each other thread was inside a long
    call, by that call's kind."""
    threads = sorted({thread for _, thread, _, _ in stalls})
    by_kind: dict[str, dict[str, list[tuple[float, float]]]] = defaultdict(lambda: defaultdict(list))
    for kind, thread, a, b in stalls:
        by_kind[thread][kind].append((a, b))
    out = {}
    for t in threads:
        own = union_of([iv for kind, ivs in by_kind[t].items() if kind not in HOLDING for iv in ivs])
        total = sum(b - a for a, b in own)
        if not total:
            continue
        during = {u: {kind: round(overlap_length(own, union_of(ivs)) / total, 3)
                      for kind, ivs in sorted(by_kind[u].items())}
                  for u in threads if u != t}
        out[t] = {"stall_ms": round(1e3 * total, 1), "stalls": len(own), "during": during}
    return out


def _thread_cpu_s() -> dict[int, float]:
    """CPU seconds (user + system) of each of this process's threads, by native thread id (Linux)."""
    ticks = os.sysconf("SC_CLK_TCK")
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        seconds[int(tid)] = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
    return seconds
