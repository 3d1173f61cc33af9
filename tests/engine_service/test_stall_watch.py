"""A worker that stops running Python says so, and says what held it (engine_service/stall_watch.py).

Real stalls in this process: a thread in a C call that keeps the GIL, and a full walk of the cyclic GC over a
large heap. Each is sized from this machine's own speed, so the stall is several times the report threshold.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
from structlog.testing import capture_logs

from engine_service.server import EngineWorker, WorkerSettings
from engine_service.stall_watch import StallWatch
from engines.instant import InstantEngine

REPORT_AFTER_S = 0.15
STALL_S = 0.6  # what each test's stall is sized to


def _hold_the_gil(n: int, release: threading.Event) -> None:
    sum(range(n))  # one C call over a range: it never gives the GIL up
    release.wait(5)  # stays in this frame while the watch looks


def _gil_holding_count(seconds: float) -> int:
    n, took = 1_000_000, 0.0
    while took < 0.05:
        n *= 2
        started = time.perf_counter()
        sum(range(n))
        took = time.perf_counter() - started
    return int(n * seconds / took)


@pytest.fixture
def watch():
    watch = StallWatch(period_s=0.02, report_after_s=REPORT_AFTER_S)
    watch.start()
    yield watch
    watch.stop()


def _stalls(logs: list[dict]) -> list[dict]:
    return [e for e in logs if e["event"] == "worker_stalled"]


def test_a_thread_that_keeps_the_gil_is_reported_with_where_it_was(watch: StallWatch) -> None:
    n, release = _gil_holding_count(STALL_S), threading.Event()
    holder = threading.Thread(target=_hold_the_gil, args=(n, release), name="gil-holder")
    with capture_logs() as logs:
        holder.start()
        deadline = time.monotonic() + 10
        while not _stalls(logs) and time.monotonic() < deadline:
            time.sleep(0.02)
        release.set()
        holder.join()
    stalls = _stalls(logs)
    assert stalls, "a 0.6-s hold of the GIL went unreported"
    longest = max(stalls, key=lambda e: e["stalled_s"])
    assert longest["stalled_s"] >= REPORT_AFTER_S
    assert any("_hold_the_gil" in frame for frame in longest["threads"]["gil-holder"])  # it, or the wait it went on to
    # (the calibration before may have stalled the watch too, on a busy machine)
    assert watch.stalls >= len(stalls) and watch.stalled_s >= longest["stalled_s"] - 0.001  # the log rounds to ms


def test_a_long_walk_of_the_cyclic_gc_is_named_in_the_report() -> None:
    # A finer watch than the worker's (its 0.25 s would need ~30 M live objects here, 2 GB): live objects the
    # collector must walk, grown until one full collection takes 3x this watch's threshold (~3 M, 200 MB).
    watch = StallWatch(period_s=0.005, report_after_s=0.03)
    heap: list[list] = []
    took = 0.0
    gc.disable()  # no automatic collections (stalls of their own) while it grows
    try:
        while took < 3 * watch.report_after_s and len(heap) < 8_000_000:
            heap.extend([[] for _ in range(max(1_000_000, len(heap)))])
            started = time.perf_counter()
            gc.collect()
            took = time.perf_counter() - started
    finally:
        gc.enable()
    if took < 2 * watch.report_after_s:
        pytest.skip(f"a full collection of {len(heap)} objects took only {took:.3f} s here")
    watch.start()
    try:
        with capture_logs() as logs:
            time.sleep(0.05)
            gc.collect()
            time.sleep(0.05)  # the watch reports once it runs again
    finally:
        watch.stop()
    reported = [c for e in _stalls(logs) for c in e["gc_collections"]]
    assert any(c["generation"] == 2 and c["seconds"] >= watch.report_after_s for c in reported), _stalls(logs)
    del heap


def test_a_scrape_counts_the_stalls(watch: StallWatch) -> None:
    worker = EngineWorker(InstantEngine(), WorkerSettings())
    worker.metrics.watch_stalls(watch)
    before = worker.metrics.registry.get_sample_value("tts_worker_stalls_total")
    release = threading.Event()
    release.set()
    _hold_the_gil(_gil_holding_count(STALL_S), release)
    time.sleep(0.1)
    assert worker.metrics.registry.get_sample_value("tts_worker_stalls_total") >= before + 1
    assert worker.metrics.registry.get_sample_value("tts_worker_stalled_seconds_total") >= REPORT_AFTER_S
