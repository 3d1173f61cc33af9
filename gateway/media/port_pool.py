"""Which UDP port pairs the gateway hands to calls: even RTP ports with RTCP on port + 1 (RFC 3550 §11).

Pure bookkeeping, no sockets: the session that binds a candidate reports back whether the bind worked.
Candidates are drawn at random from the free ports (RFC 3550 §9.1 and RFC 3711 §9 ask that an
attacker not be able to guess the next call's port: handing them out in order let a third party aim
at a call it never saw the signalling of). A just-released port waits in a short quarantine behind
every other free port, so a late packet of an old call does not land in the next one; it is handed
out again only when nothing else is free.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

# Random draws before falling back to a scan of the whole range: with the pool mostly free a draw
# hits a free port at once; when it is nearly full the scan finds the few that are left.
_RANDOM_DRAWS = 16
_QUARANTINE_MAX = 64


class PortsExhausted(RuntimeError):
    """Every even port in the configured range is in use."""


class RtpPortPool:
    def __init__(self, port_min: int, port_max: int) -> None:
        first = port_min + (port_min % 2)
        if first + 1 > port_max:
            raise ValueError(f"rtp port range {port_min}-{port_max} holds no even/odd pair")
        self._ports = range(first, port_max, 2)  # port_max may be the last RTCP port
        self._in_use: set[int] = set()
        # Released ports, oldest first (a dict: ordered, O(1) removal when one is taken after all).
        self._quarantine: dict[int, None] = {}
        self._quarantine_max = min(_QUARANTINE_MAX, len(self._ports) // 2)
        self._random = random.SystemRandom()

    def candidates(self) -> Iterator[int]:
        """Free even ports in random order, quarantined ones last (oldest first); take one with `acquire`."""
        offered: set[int] = set()
        for _ in range(_RANDOM_DRAWS):
            port = self._ports[self._random.randrange(len(self._ports))]
            if port not in offered and self._available(port):
                offered.add(port)
                yield port
        rest = [port for port in self._ports if port not in offered and self._available(port)]
        self._random.shuffle(rest)
        for port in rest:
            if self._available(port):  # again: binds await, and another call may have taken it since
                offered.add(port)
                yield port
        # A copy: a failed bind releases its port into the quarantine while we iterate.
        yield from (port for port in list(self._quarantine) if port not in self._in_use and port not in offered)

    def _available(self, port: int) -> bool:
        return port not in self._in_use and port not in self._quarantine

    def acquire(self, port: int) -> None:
        self._in_use.add(port)
        self._quarantine.pop(port, None)

    def release(self, port: int) -> None:
        self._in_use.discard(port)
        if self._quarantine_max:
            self._quarantine[port] = None
            if len(self._quarantine) > self._quarantine_max:
                del self._quarantine[next(iter(self._quarantine))]

    @property
    def in_use(self) -> int:
        return len(self._in_use)

    @property
    def total(self) -> int:
        """Port pairs in the configured range."""
        return len(self._ports)

    @property
    def free(self) -> int:
        """Pairs no call holds (quarantined ones count: they are handed out when nothing else is free).
        Another process may still hold some of them: a bind that fails there moves on to the next."""
        return len(self._ports) - len(self._in_use)
