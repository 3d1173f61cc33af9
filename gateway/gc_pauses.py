"""Times the cyclic garbage collector's pauses into `gateway_gc_pause_seconds{generation}`.

A collection runs on the event loop's thread between two callbacks, so its length is how late the packet
clock's next tick can be. A full (generation 2) collection walks every tracked object of every live call: at
a thousand calls it is a stall every call hears, which the lateness histogram shows but cannot name. This
module only measures; `gc.freeze()` at start (gateway/app.py) is what keeps the walk short.
"""

from __future__ import annotations

import gc
import time

from gateway import metrics


class _PauseTimer:
    """A gc.callbacks entry: start and stop of each collection, observed into its generation's histogram."""

    def __init__(self) -> None:
        self._pauses = [metrics.gc_pause_seconds.labels(generation=str(g)) for g in range(3)]
        self._started: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self._pauses[info["generation"]].observe(time.perf_counter() - self._started)
            self._started = None


def watch() -> None:
    """Time every collection of this process from now on (idempotent)."""
    if not any(isinstance(callback, _PauseTimer) for callback in gc.callbacks):
        gc.callbacks.append(_PauseTimer())
