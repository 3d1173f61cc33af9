"""GraphSwap: one group of captured graphs that its replaying thread uses, and the group that replaces
it, published by another thread.

A worker becomes ready on graphs recorded from the eager modules (no torch.compile tracing: seconds,
not a minute), then a background thread compiles, records the compiled graphs of each group (the
decoder's, each render lane's flow solves and HiFT) and `publish`es them. The group's owner, the one
thread that replays it, adopts a published group only at its swap point, `take`, called where none
of its graphs is half-launched: the decode thread at the start of a step's launch, a render lane at
the start of a render call. So no thread ever replays a graph that is being replaced, and a group
changes whole (a lane never mixes compiled solves with eager HiFT of another generation).

`settle` (given to `take`) runs on the owner thread before the old group is dropped: the decoder
waits there for its steps in flight, so the old graphs' memory is not released while they run.
Pure bookkeeping, no CUDA: the CPU tests exercise it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

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
        return group
