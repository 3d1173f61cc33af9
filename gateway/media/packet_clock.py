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

Phases: the calls are spread over `phases` evenly spaced slots of the period (PHASES slots of 2 ms by
default), each call always in the same slot. A tick then serves a tenth of the calls, so the time
from a slot's deadline to a given call's packet (its place in the slot's queue) is a tenth of what
one 20 ms burst for every call would give, and so is its variation from tick to tick: that variation
is the send jitter a receiver sees. Other work on the loop (a call set up or torn down) that holds a
slot back delays only that slot's calls. Packet timing per call is unchanged: still one packet per
20 ms, with RTP timestamps from the packet tick index.

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
# 10 slots of 2 ms: at 500 calls a slot is ~0.8 ms of sends. Paired on one GPU host at 500 calls, RTP
# interval p99 at the caller 22.2-22.5 ms against 22.8-23.6 with 4 slots of 5 ms (docs/PERF_NOTES.md).
PHASES = 10
TickCallback = Callable[[int, float], None]


def due_ticks(now: float, t0: float, next_index: int, max_catch_up: int,
              period: float = PERIOD_S) -> tuple[range, int]:
    """Which tick indices to run at `now`, and how many to skip (pure, for the catch-up policy)."""
    latest = int((now - t0) / period)  # the newest deadline that has passed
    if latest < next_index:
        return range(next_index, next_index + 1), 0  # woken a hair early by float rounding: run it
    first = max(next_index, latest - max_catch_up)
    return range(first, latest + 1), first - next_index


class PacketClock:
    def __init__(self, max_catch_up: int = 3, phases: int = PHASES) -> None:
        if phases < 1:
            raise ValueError("phases must be >= 1")
        self.max_catch_up = max_catch_up
        self.phases = phases
        self.skipped_ticks = 0  # in slot ticks (PERIOD_S / phases each)
        self._slot_period = PERIOD_S / phases
        self._phase_subscribers: list[dict[TickCallback, None]] = [{} for _ in range(phases)]  # ordered sets
        self._phase_of: dict[TickCallback, int] = {}
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
        """Serve `callback` once per period, in the least used slot (it keeps that slot)."""
        if callback in self._phase_of:
            return
        phase = min(range(self.phases), key=lambda p: len(self._phase_subscribers[p]))
        self._phase_subscribers[phase][callback] = None
        self._phase_of[callback] = phase

    def unsubscribe(self, callback: TickCallback) -> None:
        phase = self._phase_of.pop(callback, None)
        if phase is not None:
            self._phase_subscribers[phase].pop(callback, None)

    def last_tick(self, callback: TickCallback) -> int | None:
        """The index of the newest packet tick whose slot for `callback` has already run (None: none yet).

        A talkspurt's first frame that arrives between ticks may go out at once as this tick's packet: its
        deadline has passed, so the packet is late by less than a period, like a caught-up tick, never early,
        and its RTP timestamp stays on the clock's timeline (gateway/media/call_media.py)."""
        phase = self._phase_of.get(callback)
        if phase is None:
            return None
        ran = self._next - 1  # the newest slot run
        slot = ran - (ran - phase) % self.phases
        return slot // self.phases if slot >= 0 else None

    def tick_at(self, loop_time: float) -> float:
        """Fractional tick index of a loop time (for RTP timestamps of things between ticks)."""
        return (loop_time - self._t0) / PERIOD_S

    def run_if_due(self) -> None:
        """Run the next tick now if its deadline has passed (called between items of bulk work)."""
        if self._handle is not None and self._loop is not None \
                and self._loop.time() >= self._t0 + self._next * self._slot_period:
            self._handle.cancel()
            self._tick()

    def _tick(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        slots, skipped = due_ticks(now, self._t0, self._next, self.max_catch_up * self.phases, self._slot_period)
        if skipped:
            self.skipped_ticks += skipped
            metrics.packet_clock_skipped_ticks_total.inc(skipped)
            log.warning("packet_clock_skipped", slot_ticks=skipped,
                        behind_ms=round((now - self._t0 - self._next * self._slot_period) * 1000))
        for slot in slots:
            index, phase = divmod(slot, self.phases)  # the packet tick, and which slot of it
            deadline = self._t0 + slot * self._slot_period
            metrics.packet_clock_lateness_seconds.observe(max(0.0, now - deadline))
            for callback in tuple(self._phase_subscribers[phase]):  # a copy: callbacks may unsubscribe
                try:
                    callback(index, deadline)
                except Exception:
                    log.exception("packet_clock_subscriber_failed", subscriber=repr(callback))
            now = self._loop.time()  # later slots of a catch-up run are measured from when they run
        self._next = slots[-1] + 1
        self._handle = self._loop.call_at(self._t0 + self._next * self._slot_period, self._tick)
