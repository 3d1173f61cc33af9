"""Notices when this worker's Python stops running, and says what held it.

A gateway calls a worker dead after ~1 s without a status frame (the heartbeat, every 250 ms) and ends every call
on the link. Whatever holds the GIL that long (a C call that does not release it, a full walk of the cyclic GC, the
tts-compile thread) stops the event loop, the decode thread and the render lanes alike, and none of them can log
it: they were not running. On an H200 a worker went silent for 1 s once per start-up while its compiled flow
graphs were being made after ready (docs/PERF_NOTES.md); with calls on the link that would have ended them all.

A daemon thread sleeps `period_s` at a time. When it wakes more than `report_after_s` late it logs
`worker_stalled`: how long, the collections of the cyclic GC that ran in that time, and where every other thread
is now (its innermost frames: the thread that held the GIL is just past what held it). It counts into
`tts_worker_stalls_total` and `tts_worker_stalled_seconds_total` (engine_service.metrics). It only watches.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger(__name__)

FRAMES_SHOWN = 3  # innermost frames of each thread in a report


@dataclass
class _Collection:
    generation: int
    started: float
    seconds: float


@dataclass
class StallWatch:
    period_s: float = 0.05
    report_after_s: float = 0.25
    stalls: int = 0
    stalled_s: float = 0.0
    _collections: list[_Collection] = field(default_factory=list)
    _gc_running: _Collection | None = None  # its seconds filled in at the stop callback
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None

    def _on_gc(self, phase: str, info: dict) -> None:
        now = time.monotonic()
        if phase == "start":
            self._gc_running = _Collection(info["generation"], now, 0.0)
        elif (running := self._gc_running) is not None:
            self._gc_running = None
            running.seconds = now - running.started
            if running.seconds >= self.period_s:  # only collections long enough to matter
                self._collections.append(running)
                del self._collections[:-16]

    def _run(self) -> None:
        expected = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, expected - time.monotonic())):
            now = time.monotonic()
            late = now - expected
            if late > self.report_after_s:
                self._report(expected, late)
            expected = now + self.period_s

    def _report(self, since: float, late: float) -> None:
        self.stalls += 1
        self.stalled_s += late
        now = time.monotonic()
        # The watch often runs again inside the stop callback of the collection that held it (Python code, where the
        # GIL changes hands), before that collection is recorded: a running one counts up to now.
        running = [] if (r := self._gc_running) is None else [_Collection(r.generation, r.started, now - r.started)]
        collections = [{"generation": c.generation, "seconds": round(c.seconds, 3)}
                       for c in list(self._collections) + running if c.started + c.seconds >= since]
        log.error("worker_stalled", stalled_s=round(late, 3), gc_collections=collections,
                  threads=_where_threads_are())


def _where_threads_are() -> dict[str, list[str]]:
    """Each other thread's innermost frames, innermost first, as 'file:line function'."""
    names = {t.ident: t.name for t in threading.enumerate()}
    here = threading.get_ident()
    where: dict[str, list[str]] = {}
    for ident, frame in sys._current_frames().items():
        if ident == here:
            continue
        frames = []
        while frame is not None and len(frames) < FRAMES_SHOWN:
            code = frame.f_code
            frames.append(f"{_short(code.co_filename)}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        where[names.get(ident, str(ident))] = frames
    return where


def _short(path: str) -> str:
    """The path's last three parts ('torch/_inductor/graph.py'): enough to find the file, not the prefix."""
    return "/".join(path.split("/")[-3:])
