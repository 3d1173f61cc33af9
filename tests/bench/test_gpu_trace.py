"""bench/gpu_trace.py: per-stream figures from a list of kernels (the profiler itself needs a GPU)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from gpu_trace import Kernel, kernels, summarize


def test_streams_overlap_gaps_and_busy_time() -> None:
    decode = [Kernel(1, "gemm", 0.0, 10.0), Kernel(1, "attention", 12.0, 8.0), Kernel(1, "gemm", 200.0, 10.0)]
    flow = [Kernel(2, "conv", 5.0, 10.0)]
    out = summarize(decode + flow, gap_limit_us=100.0)
    assert out["span_ms"] == pytest.approx(0.210)
    one, two = out["streams"]["1"], out["streams"]["2"]
    assert one["kernels"] == 3 and one["kernel_ms"] == pytest.approx(0.028) and one["busy_ms"] == pytest.approx(0.028)
    # The flow kernel (5-15 us) runs beside 5-10 and 12-15 of the decode stream's kernels.
    assert one["overlapped_ms"] == pytest.approx(0.008) and two["overlapped_ms"] == pytest.approx(0.008)
    # 10 -> 12 is a wait inside a step; 20 -> 200 is longer than the limit: between steps, not counted.
    assert one["gap_ms"] == pytest.approx(0.002) and two["gap_ms"] == 0
    # ... counted as the stream's idle time instead, with the kernel that ended it.
    assert one["long_gaps"] == 1 and one["long_gap_ms"] == pytest.approx(0.180)
    assert one["after_long_gap"] == {"gemm": 1} and two["long_gaps"] == 0 and two["after_long_gap"] == {}
    assert [t["name"] for t in one["top"]] == ["gemm", "attention"]
    assert one["top"][0]["count"] == 2 and one["top"][0]["mean_us"] == pytest.approx(10.0)


def test_overlapping_kernels_of_one_stream_count_once_in_busy_time() -> None:
    out = summarize([Kernel(3, "a", 0.0, 10.0), Kernel(3, "b", 5.0, 10.0)])
    assert out["streams"]["3"]["busy_ms"] == pytest.approx(0.015)
    assert out["streams"]["3"]["kernel_ms"] == pytest.approx(0.020)
    assert summarize([]) == {"span_ms": 0.0, "gap_limit_us": 100.0, "streams": {}}



class _Event:
    """A kineto event as torch 2.11 gives it: no `activity_type`."""

    def __init__(self, name: str, stream: int, start_ns: int, dur_ns: int,
                 device: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA) -> None:
        self._name, self._stream, self._start, self._dur, self._device = name, stream, start_ns, dur_ns, device

    def name(self) -> str:
        return self._name

    def device_type(self) -> torch.autograd.DeviceType:
        return self._device

    def device_resource_id(self) -> int:
        return self._stream

    def start_ns(self) -> int:
        return self._start

    def duration_ns(self) -> int:
        return self._dur


def test_events_without_an_activity_type_are_told_apart_by_name() -> None:
    events = [_Event("nvjet_sm90_gemm", 7, 1000, 2000), _Event("Memcpy HtoD (Pinned -> Device)", 7, 0, 500),
              _Event("Memset (Device)", 9, 0, 100), _Event("aten::mm", 0, 0, 10, torch.autograd.DeviceType.CPU)]
    prof = SimpleNamespace(profiler=SimpleNamespace(kineto_results=SimpleNamespace(events=lambda: events)))
    found, seen = kernels(prof)
    assert seen == {"kernel": 1, "gpu_memcpy": 1, "gpu_memset": 1}  # the CPU op is no device event
    assert found == [Kernel(stream=7, name="nvjet_sm90_gemm", start_us=1.0, dur_us=2.0)]
