"""GraphSwap: one group of captured graphs that its replaying thread uses, and the group that replaces
it, published by another thread.

A worker becomes ready on graphs recorded from the eager modules (no torch.compile tracing: seconds,
not a minute), then a background thread compiles, records the compiled graphs of each group (the
decoder's, each render lane's flow solves and HiFT) and `publish`es them. The group's owner, the one
thread that replays it, adopts a published group only at its swap point, `take`, called where none
of its graphs is half-launched: the decode thread at the start of a step's launch, a render lane at
the start of a render call. So no thread ever replays a graph that is being replaced, and a group
changes whole (a lane never mixes compiled solves with eager HiFT of another generation).

`settle` (given to `take`) runs on the owner thread before the old group is let go: the decoder
waits there for its steps in flight, so the old graphs' memory is not released while they run.
The owner then hands the old group to the reaper thread, which lets go of it a piece at a time: a
CUDA graph's destructor runs with the GIL held, ~0.6 us a node (an H200 took 133 ms to drop 40
graphs of 5,000 nodes: `bench/bench_graph_launch.py --lifecycle`), and in the owner it landed on the
call being served: a lone call's first chunk paid ~27 ms more on each render lane's first call after
the compiled graphs came in, and the first call's decode ~25 ms (docs/PERF_NOTES.md). Dropped beside
that call instead, a piece at a time, it still cost it 11-19 ms of solve and 26 ms of decode (the
threads that launch a solve's parts and the decode's steps wait for the GIL between launches), so the
reaper also waits until synthesis is quiet (`hold_while`: the schedulers say whether jobs are
running), at most `MAX_HOLD_S` for a group, so a host never idle still lets its old graphs go.
Pure bookkeeping, no CUDA: the CPU tests exercise it.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class GraphSwap(Generic[T]):
    def __init__(self, current: T, name: str = "") -> None:
        self.name = name
        self.current = current
        self.swaps = 0  # groups adopted by the owner
        self._pending: T | None = None
        self._lock = threading.Lock()  # publish (any thread) against take (the owner)

    def publish(self, group: T) -> None:
        """Any thread: `group` replaces the current one at the owner's next `take` (a group published
        before the owner took the previous one replaces that one unseen)."""
        with self._lock:
            self._pending = group

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def take(self, settle: Callable[[T], None] | None = None) -> T:
        """The owner thread, at its swap point: the group to replay now. Adopts a published group
        first; `settle(old)` runs before the old one is let go."""
        if self._pending is None:  # the common case, no lock: a reference read
            return self.current
        with self._lock:
            group, self._pending = self._pending, None
        if group is None:
            return self.current
        old, self.current = self.current, group
        self.swaps += 1
        if settle is not None:
            settle(old)
        REAPER.retire(old)
        return group


def _contents(piece: Any) -> list:
    """What a piece holds, to let go of one by one: a container's items, an object's attributes (a solve
    bucket holds its ten part graphs). Called only for a piece nothing else holds, so a shared model
    referenced from a graph set is never walked into."""
    if isinstance(piece, dict):
        return list(piece.values())
    if isinstance(piece, (list, tuple)):
        return list(piece)
    attrs = getattr(piece, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) else []


class Reaper:
    """Lets go of retired groups on a daemon thread of its own, one piece at a time: containers (dict,
    list, tuple) and objects nothing else holds are opened and what they hold dropped one by one with a
    pause between them, so no thread waits behind the GIL for a whole group's destructors at once; and
    only while no registered `busy` check says synthesis is running, or once a group has waited
    `MAX_HOLD_S`."""

    PAUSE_S = 0.002  # between pieces: the serving threads get the GIL back
    QUIET_POLL_S = 0.05  # how often a held group looks again for a quiet moment
    MAX_HOLD_S = 30.0  # a group waits at most this long for one; then it goes, paced, beside the calls
    OWNER_GRACE_S = 1.0  # how long a retired group may still be held by its owner before it is opened anyway

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._busy: list[Callable[[], bool]] = []
        self.reaped = 0  # pieces let go (tests)

    def hold_while(self, busy: Callable[[], bool]) -> Callable[[], None]:
        """Hold retired groups while `busy()` (called on the reaper's thread: a cheap read, no lock held long);
        returns the call that takes `busy` back (a stopping scheduler)."""
        with self._lock:
            self._busy.append(busy)

        def release() -> None:
            with self._lock:
                if busy in self._busy:
                    self._busy.remove(busy)
        return release

    def _quiet(self) -> bool:
        with self._lock:
            checks = list(self._busy)
        return not any(check() for check in checks)

    def retire(self, group: Any) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="graph-reaper", daemon=True)
                self._thread.start()
        self._queue.put(group)

    def _run(self) -> None:
        while True:
            group = self._queue.get()
            deadline = time.monotonic() + self.MAX_HOLD_S
            # The owner's frame that retired it may hold it a moment longer: open it only once this thread holds
            # the last reference, or its pieces would go in the owner's thread when that frame ends.
            let_go_by = time.monotonic() + self.OWNER_GRACE_S
            while sys.getrefcount(group) > 2 and time.monotonic() < let_go_by:
                time.sleep(self.PAUSE_S)
            pieces = [group]
            del group
            while pieces:
                while time.monotonic() < deadline and not self._quiet():
                    time.sleep(self.QUIET_POLL_S)
                piece = pieces.pop()
                inside = _contents(piece) if sys.getrefcount(piece) <= 2 else ()  # 2: `piece` and the argument
                if inside:
                    pieces.extend(inside)
                else:
                    self.reaped += 1
                del piece, inside  # the last reference, unless another owner still holds it
                time.sleep(self.PAUSE_S)


REAPER = Reaper()
