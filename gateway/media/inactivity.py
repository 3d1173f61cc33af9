"""Ends what a vanished caller leaves behind: a call whose peer has sent no RTP and no RTCP for too long.

A caller that disappears without BYE (power cut, lost NAT binding, crashed softphone, a PBX that lost
the leg) leaves a dialog nobody will end; a `stay` call would hold its engine slot and ports until
shutdown. A live peer sends RTP while the stream is active, and RTCP at least every few seconds
whatever it sends (RFC 3550 §6.2, §6.3.5), so silence on both is the caller being gone.

Hold: while the stream is on hold (our answer is not sendrecv, or the peer's address is 0.0.0.0) the
peer may legitimately send no RTP (RFC 3264 §5.1, §8.4), and many phones and PBXs stop RTCP too, so
the silence is measured against the longer `hold_timeout_s` instead (as Asterisk's rtp_timeout_hold,
whose sample value of 300 s is our default): a held caller who vanished is ended too, and one whose
phone keeps sending RTCP while held is never. Going on hold and resuming are signs of life: each
starts the count afresh. Session timers (RFC 4028), which would also catch a vanished caller through
signalling, are not implemented yet (issue #32).

This module only measures and waits; the call session decides what ending means (a BYE).
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Protocol


class HeardPeer(Protocol):
    def silence(self) -> tuple[float, bool]:
        """(monotonic time since which nothing has arrived from the peer, whether the stream is on hold)."""


async def peer_silent_for(media: HeardPeer, timeout_s: float, hold_timeout_s: float) -> tuple[float, bool]:
    """Return once `media` has heard nothing from its peer for `timeout_s` seconds off hold, or for
    `hold_timeout_s` on hold (0: never in that state; at least one must be positive); returns (the
    silence in seconds, whether on hold).
    Wakes about once per shortest timeout while media keeps arriving (no per-packet cost)."""
    period = min(limit for limit in (timeout_s, hold_timeout_s) if limit > 0)  # a state change is seen within it
    while True:
        since, on_hold = media.silence()
        limit = hold_timeout_s if on_hold else timeout_s
        now = time.monotonic()
        wait = since + limit - now if limit > 0 else math.inf
        if wait <= 0:
            return now - since, on_hold
        await asyncio.sleep(min(wait, period))
