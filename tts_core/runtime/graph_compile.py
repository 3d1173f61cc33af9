"""GraphCompile: the tts-compile thread, which compiles and captures the compiled graphs once the loops serve.

The scheduler serves from graphs of the eager modules as soon as it starts; this thread then compiles and captures
the decoder's graphs, then each render lane's (and the later lane's deferred flow buckets), publishing each group
as it is done. The decode thread and each render lane swap them in at their own swap point
(tts_core/accel/graph_swap.py). It owns `state`, what the engine's health says of the graphs
(engines.base.GraphsState): compiled (also with nothing to compile), compiling, failed.

It never touches jobs, slots or the scheduler's lock, and a failure here never stops serving: the loops go on
with the graphs they have.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import structlog
import torch

from tts_core.runtime.lm_runner import LMRunner

log = structlog.get_logger(__name__)

COMPILE_SWITCH_INTERVAL_S = 0.0002  # while the tts-compile thread traces (`run`)


class GraphCompile:
    def __init__(self, runner: LMRunner, renderer: Any, device: torch.device,
                 is_stopping: Callable[[], bool]) -> None:
        """`renderer`: the scheduler's ChunkRenderer or DiTChunkRenderer; `is_stopping`: the scheduler is
        stopping, so the thread stops after the part in hand."""
        self._runner = runner
        self._renderer = renderer
        self._device = device
        self._is_stopping = is_stopping
        # A plain attribute this thread sets and the event loop reads.
        self.state = "compiled"
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.state = "compiling"
        self._thread = threading.Thread(target=self.run, name="tts-compile", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the compiled graphs are captured and published; False if still capturing after `timeout`."""
        if self._thread is not None:
            self._thread.join(timeout)
        return not self.running

    def stop(self, timeout: float | None) -> None:
        """After the scheduler says it is stopping: the thread stops after the part in hand; a compile in progress
        cannot be cut short and is not waited for long (a daemon thread: a closing worker's exit ends it)."""
        if self._thread is not None:
            self._thread.join(min(timeout, 1.0) if timeout is not None else 1.0)
            self._thread = None

    def run(self) -> None:
        """The thread's body. Dynamo's tracing is Python holding the GIL for seconds: a shorter switch interval
        meanwhile lets the serving threads have it back sooner. Logs compiled_graphs_complete (or the failure:
        serving goes on, on the graphs it has)."""
        started = time.perf_counter()
        interval = sys.getswitchinterval()
        sys.setswitchinterval(COMPILE_SWITCH_INTERVAL_S)
        report: dict = {}
        try:
            torch.set_grad_enabled(False)  # thread-local
            with torch.cuda.device(self._device):
                if not self._is_stopping():
                    report["decode"] = self._runner.capture_compiled()
                    _freeze_what_the_compile_made()
                report.update(self._renderer.capture_compiled(self._is_stopping))
                _freeze_what_the_compile_made()
        except Exception:  # noqa: BLE001 - serving goes on from the graphs it has; say so
            self.state = "failed"
            log.exception("compiled_graphs_failed", seconds=round(time.perf_counter() - started, 2))
            return
        finally:
            sys.setswitchinterval(interval)
        if not self._is_stopping():  # stopped part-way: still not compiled
            self.state = "compiled"
        log.info("compiled_graphs_complete" if not self._is_stopping() else "compiled_graphs_stopped",
                 seconds=round(time.perf_counter() - started, 2), parts=report)


def _freeze_what_the_compile_made() -> None:
    """Dynamo and inductor leave millions of long-lived objects (graphs, guards, generated code) that every later
    full collection would walk with the GIL held: a 0.27-s walk during the compile stopped every serving thread on
    the H200 (`worker_stalled`, PERF_NOTES session 9). Freezing moves them out of the walk. No collection first
    (that would be the same walk): what is garbage in a cycle at this moment stays allocated, once per part."""
    gc.freeze()
