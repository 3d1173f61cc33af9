"""Which UDP port pairs the gateway hands to calls: even RTP ports with RTCP on port + 1 (RFC 3550 §11).

Pure bookkeeping, no sockets: the pool hands out candidates round-robin (so a just-released port is
not reused at once and a late packet of an old call cannot land in a new one); the session that binds
them reports back whether the bind worked.
"""

from __future__ import annotations


class PortsExhausted(RuntimeError):
    """Every even port in the configured range is in use."""


class RtpPortPool:
    def __init__(self, port_min: int, port_max: int) -> None:
        first = port_min + (port_min % 2)
        if first + 1 > port_max:
            raise ValueError(f"rtp port range {port_min}-{port_max} holds no even/odd pair")
        self._ports = range(first, port_max, 2)  # port_max may be the last RTCP port
        self._in_use: set[int] = set()
        self._cursor = 0

    def candidates(self):
        """Free even ports, starting after the last one handed out; take one with `acquire`."""
        count = len(self._ports)
        for step in range(count):
            port = self._ports[(self._cursor + step) % count]
            if port not in self._in_use:
                yield port

    def acquire(self, port: int) -> None:
        self._in_use.add(port)
        self._cursor = (self._ports.index(port) + 1) % len(self._ports)

    def release(self, port: int) -> None:
        self._in_use.discard(port)

    @property
    def in_use(self) -> int:
        return len(self._in_use)
