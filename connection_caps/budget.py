"""What a listener may hold: connections in total and per source, and the process's descriptor budget.

Pure counting, no sockets and no clocks. `DescriptorBudget` is one per process: the connection-oriented
listeners (the gateway's HTTP port and SIP TCP) draw on it, and what it never hands out (`reserved`) stays for
the sockets that must always open (RTP/RTCP pairs, log files, a worker's link). `ConnectionCaps` is one per
listener: its total and per-source caps, plus a small `reserve` of connections admitted past both caps on
probation (the listener must then see the connection prove it is trusted, e.g. present the engine token).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

# Descriptors never handed to connection listeners, beyond those open when the budget is made and the RTP/RTCP
# sockets the caller counts: files and pipes opened later (log reopen, a worker restarted), resolver sockets, and
# sockets accepted but not yet judged (asyncio accepts up to a backlog's worth per round before any is closed:
# two rounds of listener.ACCEPT_BACKLOG).
BASE_RESERVE = 160


class DescriptorBudget:
    """Descriptors that connection listeners may hold at once, shared by all of them in a process."""

    def __init__(self, available: int) -> None:
        self.available = max(0, available)
        self.in_use = 0

    @classmethod
    def from_rlimit(cls, reserved: int) -> DescriptorBudget:
        """RLIMIT_NOFILE's soft limit less the descriptors open now, `reserved` (e.g. two per call for RTP/RTCP)
        and BASE_RESERVE."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            soft = 1 << 20
        return cls(soft - _open_now() - reserved - BASE_RESERVE)

    def take(self) -> bool:
        if self.in_use >= self.available:
            return False
        self.in_use += 1
        return True

    def give_back(self) -> None:
        self.in_use -= 1


@dataclass
class ConnectionCaps:
    """One listener's caps. `admit` answers None (admitted), "probation" (past a cap, taken from the reserve:
    the listener must confirm or close it) or the reason it is refused."""

    max_connections: int
    max_connections_per_source: int
    reserve: int = 0  # connections past the caps, on probation (a worker keeps them for its gateways' links)
    budget: DescriptorBudget | None = None
    open: int = 0
    on_probation: int = 0
    _per_source: dict[str, int] = field(default_factory=dict)

    def admit(self, source: str) -> str | None:
        if self.budget is not None and not self.budget.take():
            return "descriptors"
        over = None
        if self.open - self.on_probation >= self.max_connections:
            over = "max_connections"
        elif self._per_source.get(source, 0) >= self.max_connections_per_source:
            over = "max_connections_per_source"
        if over is not None:
            if self.on_probation >= self.reserve:
                if self.budget is not None:
                    self.budget.give_back()
                return over
            self.on_probation += 1
            over = "probation"
        self.open += 1
        self._per_source[source] = self._per_source.get(source, 0) + 1
        return over

    def release(self, source: str, probation: bool) -> None:
        self.open -= 1
        if probation:
            self.on_probation -= 1
        left = self._per_source.get(source, 1) - 1
        if left > 0:
            self._per_source[source] = left
        else:
            self._per_source.pop(source, None)
        if self.budget is not None:
            self.budget.give_back()

    def confirm(self) -> None:
        """A connection on probation proved trusted: it stays, and its reserve place is free again (it still
        counts in `open`, so a flood plus trusted links never exceeds caps + reserve + trusted links)."""
        self.on_probation -= 1


def _open_now() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # no /proc (not Linux): BASE_RESERVE alone
        return 0
