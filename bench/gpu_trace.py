"""What the GPU did, per CUDA stream, over a profiled stretch: for telling a decode step that waits
between its kernels (for SMs held by other streams' blocks) from one whose kernels themselves run
slower (sharing memory bandwidth), which call for different cures.

`record(work)` profiles CUDA activity only (CUPTI, process-wide: every thread's streams, kernels
inside CUDA graph replays included) while `work` runs; `summary` (`kernels`, then `summarize`) turns
what it saw into per-stream figures:
  kernels, kernel_ms      how many kernels ran on the stream and their summed durations
  busy_ms                 the union of their intervals (what the stream occupied)
  overlapped_ms           of busy_ms, the part during which another stream also ran a kernel
  gap_ms                  the summed gaps between consecutive kernels shorter than `gap_limit_us`
                          (inside one graph replay: the time a ready kernel waited to start)
  long_gaps, long_gap_ms  the gaps of at least `gap_limit_us`: how many, and their sum (the stream idle)
  after_long_gap          the kernels that start after a long gap, by name and count: always a
                          step's first kernel means the stream waited for its launch (the host);
                          kernels from inside a step mean it waited for the GPU
  top                     the kernel names with the most summed time, with count and mean us
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise

import torch


@dataclass(frozen=True)
class Kernel:
    stream: int
    name: str
    start_us: float
    dur_us: float

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us


def record(work: Callable[[], object]):
    """Run `work` under the profiler (CUDA activity only; CPU ops without CUDA) and return it.
    Reading its events is slow Python work: do it (`kernels`) once the measured stretch is over."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return prof


def kernels(prof) -> tuple[list[Kernel], dict[str, int]]:
    """The GPU kernels a profile saw (none without CUDA), and how many device events of each
    activity type (kernels, copies, ...) it saw, for a check that it saw any."""
    found, seen = [], defaultdict(int)
    for event in prof.profiler.kineto_results.events():
        if event.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        kind = _activity(event)
        seen[kind] += 1
        if "kernel" in kind:
            found.append(Kernel(stream=int(event.device_resource_id()), name=event.name(),
                                start_us=event.start_ns() / 1e3, dur_us=event.duration_ns() / 1e3))
    return found, dict(seen)


def _activity(event) -> str:
    """The event's activity type; torch before 2.12 has no `activity_type`, and then a device
    event is a copy or a memset by its name (kineto's "Memcpy HtoD ...", "Memset ..."), else a kernel."""
    if hasattr(event, "activity_type"):
        return event.activity_type()
    name = event.name().lower()
    return "gpu_memcpy" if name.startswith("memcpy") else "gpu_memset" if name.startswith("memset") else "kernel"


def summary(prof) -> dict:
    """`summarize` of a profile's kernels, with the device event counts."""
    found, seen = kernels(prof)
    return {**summarize(found), "device_events": seen}


def union_of(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def overlap_length(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of disjoint, sorted intervals."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def summarize(kernels: list[Kernel], gap_limit_us: float = 100.0, top: int = 12) -> dict:
    by_stream: dict[int, list[Kernel]] = defaultdict(list)
    for k in kernels:
        by_stream[k.stream].append(k)
    unions = {s: union_of([(k.start_us, k.end_us) for k in ks]) for s, ks in by_stream.items()}
    span = (max(k.end_us for k in kernels) - min(k.start_us for k in kernels)) if kernels else 0.0
    streams = {}
    for stream, ks in sorted(by_stream.items()):
        ks.sort(key=lambda k: k.start_us)
        others = union_of([iv for s, u in unions.items() if s != stream for iv in u])
        gaps = [b.start_us - a.end_us for a, b in pairwise(ks)]
        names: dict[str, list[float]] = defaultdict(list)
        for k in ks:
            names[k.name].append(k.dur_us)
        ranked = sorted(names.items(), key=lambda item: -sum(item[1]))[:top]
        long_gaps = [(g, b.name) for g, b in zip(gaps, ks[1:]) if g >= gap_limit_us]
        resumed = Counter(name[:120] for _, name in long_gaps)
        streams[str(stream)] = {
            "kernels": len(ks),
            "kernel_ms": sum(k.dur_us for k in ks) / 1e3,
            "busy_ms": sum(e - s for s, e in unions[stream]) / 1e3,
            "overlapped_ms": overlap_length(unions[stream], others) / 1e3,
            "gap_ms": sum(g for g in gaps if 0 < g < gap_limit_us) / 1e3,
            "long_gaps": len(long_gaps),
            "long_gap_ms": sum(g for g, _ in long_gaps) / 1e3,
            "after_long_gap": dict(resumed.most_common(top)),
            "top": [{"name": name[:120], "count": len(durs), "total_ms": sum(durs) / 1e3,
                     "mean_us": sum(durs) / len(durs)} for name, durs in ranked],
        }
    return {"span_ms": span / 1e3, "gap_limit_us": gap_limit_us, "streams": streams}
