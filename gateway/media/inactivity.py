"""Ends what a vanished caller leaves behind: a call whose peer has sent no RTP and no RTCP for too long.

A caller that disappears without BYE (power cut, lost NAT binding, crashed softphone, a PBX that lost
the leg) leaves a dialog nobody will end; a `stay` call would hold its engine slot and ports until
shutdown. A live peer sends RTP while the stream is active, and RTCP at least every few seconds
whatever it sends (RFC 3550 §6.2, §6.3.5), so silence on both is the caller being gone.

Hold: while the stream is on hold (our answer is not sendrecv, or the peer's address is 0.0.0.0) the
peer may legitimately send no RTP (RFC 3264 §5.1, §8.4), and many phones and PBXs stop RTCP too, so
the timer is suspended and starts afresh at resume. A held call is the PBX's to end.

This module only measures and waits; the call session decides what ending means (a BYE).
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol


class HeardPeer(Protocol):
    def silent_since(self) -> float | None:
        """Monotonic time since which nothing has arrived from the peer; None while on hold."""


async def peer_silent_for(media: HeardPeer, timeout_s: float) -> float:
    """Return once `media` has heard nothing from its peer for `timeout_s` seconds, off hold; returns the
    silence in seconds. Wakes about once per `timeout_s` while media keeps arriving (no per-packet cost)."""
    while True:
        since = media.silent_since()
        now = time.monotonic()
        if since is None:  # on hold: look again after one full period (a resume restarts the count)
            wait = timeout_s
        else:
            wait = since + timeout_s - now
            if wait <= 0:
                return now - since
        await asyncio.sleep(wait)
