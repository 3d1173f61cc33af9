"""The one 20 ms packet clock that paces every call's RTP in the process.

Tick n is due at t0 + n * 20 ms on the event loop's monotonic clock, scheduled with `loop.call_at`, so
lateness never accumulates: a late tick makes the next interval shorter, not the stream longer.

Falling behind: when a tick runs late by up to `max_catch_up` periods (a GC pause, a burst of work on a
2-core box), the missed ticks run immediately, back to back, so the receivers get every packet and the
RTP timestamps stay locked to wall time; their jitter buffers absorb the short burst. Beyond that
(the process was stalled), the missed ticks are skipped, counted and logged: bursting seconds of
audio at once would overflow the receivers' jitter buffers and be dropped there anyway. Tick indices
always name deadlines, so a skip shows up as a gap in the index.

Subscribers are plain callbacks `on_tick(tick_index, deadline)` run on the loop thread; they must be
tiny (pop a frame, encode, sendto). One failing subscriber is logged and does not stop the others.

asyncio runs every callback that is already ready before it looks at timers again, so a burst of
ready work (hundreds of calls each taking in an engine chunk) would hold a due tick back for the whole
burst. Code that does such work in a loop calls `run_if_due()` between items: a due tick then runs
at once, and the burst can delay it by one item, not by all of them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

from gateway import metrics

log = structlog.get_logger(__name__)

PERIOD_S = 0.020
TickCallback = Callable[[int, float], None]


def due_ticks(now: float, t0: float, next_index: int, max_catch_up: int) -> tuple[range, int]:
    """Which tick indices to run at `now`, and how many to skip (pure, for the catch-up policy)."""
    latest = int((now - t0) / PERIOD_S)  # the newest deadline that has passed
    if latest < next_index:
        return range(next_index, next_index + 1), 0  # woken a hair early by float rounding: run it
    first = max(next_index, latest - max_catch_up)
    return range(first, latest + 1), first - next_index


class PacketClock:
    def __init__(self, max_catch_up: int = 3) -> None:
        self.max_catch_up = max_catch_up
        self.skipped_ticks = 0
        self._subscribers: dict[TickCallback, None] = {}  # insertion-ordered set
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._t0 = 0.0
        self._next = 0

    @property
    def running(self) -> bool:
        return self._handle is not None

    @property
    def t0(self) -> float:
        """The loop time of tick 0."""
        return self._t0

    def start(self) -> None:
        """Start ticking on the running loop; tick 0 is one period from now."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time() + PERIOD_S
        self._next = 0
        self._handle = self._loop.call_at(self._t0, self._tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def subscribe(self, callback: TickCallback) -> None:
        self._subscribers[callback] = None

    def unsubscribe(self, callback: TickCallback) -> None:
        self._subscribers.pop(callback, None)

    def tick_at(self, loop_time: float) -> float:
        """Fractional tick index of a loop time (for RTP timestamps of things between ticks)."""
        return (loop_time - self._t0) / PERIOD_S

    def run_if_due(self) -> None:
        """Run the next tick now if its deadline has passed (called between items of bulk work)."""
        if self._handle is not None and self._loop is not None \
                and self._loop.time() >= self._t0 + self._next * PERIOD_S:
            self._handle.cancel()
            self._tick()

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        ticks, skipped = due_ticks(now, self._t0, self._next, self.max_catch_up)
        if skipped:
            self.skipped_ticks += skipped
            log.warning("packet_clock_skipped", ticks=skipped, behind_ms=round((now - self._t0) * 1000
                                                                                  - self._next * PERIOD_S * 1000))
        for index in ticks:
            deadline = self._t0 + index * PERIOD_S
            metrics.packet_clock_lateness_seconds.observe(max(0.0, now - deadline))
            for callback in tuple(self._subscribers):  # a copy: callbacks may unsubscribe themselves
                try:
                    callback(index, deadline)
                except Exception:
                    log.exception("packet_clock_subscriber_failed", subscriber=repr(callback))
        self._next = ticks[-1] + 1
        self._handle = self._loop.call_at(self._t0 + self._next * PERIOD_S, self._tick)
