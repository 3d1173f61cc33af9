"""RFC 4733 telephone-events: payload parse/serialize and one key press per event.

A sender describes one key press with many packets that share one RTP timestamp (the event's start,
RFC 4733 §2.5.1.2): the start (often with the marker bit), periodic updates with growing duration, and
the end packet retransmitted three times (§2.5.1.4). `DtmfDetector` reports the key on the first packet
of a new (SSRC, timestamp), so a lost start or lost end still yields exactly one press, and late
retransmits of an event already reported are ignored. No sockets, no clocks.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

_PAYLOAD = struct.Struct("!BBH")  # event, E/R/volume, duration (RFC 4733 §2.3)
DIGITS = "0123456789*#ABCD"  # DTMF event codes 0-15 (RFC 4733 §3.2)


class DtmfParseError(ValueError):
    """A telephone-event payload shorter than its 4-byte header."""


@dataclass(frozen=True)
class TelephoneEvent:
    event: int
    end: bool
    volume: int  # power level in -dBm0, 0-63
    duration: int  # in RTP timestamp units since the event's timestamp

    @classmethod
    def parse(cls, payload: bytes) -> TelephoneEvent:
        if len(payload) < _PAYLOAD.size:
            raise DtmfParseError(f"telephone-event payload of {len(payload)} bytes, need 4")
        event, flags, duration = _PAYLOAD.unpack_from(payload)
        return cls(event=event, end=bool(flags & 0x80), volume=flags & 0x3F, duration=duration)

    def serialize(self) -> bytes:
        return _PAYLOAD.pack(self.event, (self.end << 7) | (self.volume & 0x3F), self.duration)

    @property
    def digit(self) -> str | None:
        """'0'-'9', '*', '#', 'A'-'D'; None for non-DTMF events such as flash (16)."""
        return DIGITS[self.event] if self.event < len(DIGITS) else None


class DtmfDetector:
    """Turns a stream of telephone-event packets into one digit per key press."""

    def __init__(self, memory: int = 16) -> None:
        # A bounded memory of reported events: end retransmits can trail the next key's start.
        self._seen: deque[tuple[int, int]] = deque(maxlen=memory)

    def feed(self, ssrc: int, timestamp: int, payload: bytes) -> str | None:
        """The digit if this packet starts a not-yet-reported event, else None. Raises DtmfParseError."""
        event = TelephoneEvent.parse(payload)
        key = (ssrc, timestamp)
        if key in self._seen:
            return None
        self._seen.append(key)
        return event.digit
