"""The provisional responses (180, 183) the UAS core sends to one INVITE before its final response.

Reliable (RFC 3262 §3) when the INVITE requires or supports 100rel: each carries `Require: 100rel` and the
next RSeq, is resent until its PRACK (transaction.ReliableProvisional), and no second one goes before
that PRACK. Unanswered after a minute, another provisional goes (RFC 3261 §13.3.1.1: proxies' Timer C
must not cancel a call ringing in early media). inbound_call.py owns the dialog and decides when to send;
this module owns RSeq, the unacknowledged response and the minute timer.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from gateway.sip.message import SipRequest, SipResponse
from gateway.sip.session_timer import supported_options
from gateway.sip.transaction import InviteServerTransaction, ReliableProvisional, Timers

PROVISIONAL_REFRESH_S = 60.0  # RFC 3261 §13.3.1.1: "every minute"

# (status, reason, extra headers, SDP or None) -> the response, with the dialog's To tag, Contact, Server.
BuildResponse = Callable[[int, str, tuple[tuple[str, str], ...], str | None], SipResponse]


class Provisionals:
    def __init__(self, invite: SipRequest, transaction: InviteServerTransaction, build: BuildResponse,
                 timers: Timers, reliable_transport: bool, on_prack_timeout: Callable[[], None]) -> None:
        # Require: 100rel obliges us; Supported: 100rel lets us choose, and we choose reliable early media,
        # so a lost 183 (the SDP answer the early RTP belongs to) is resent, not missed.
        self.reliable = wants_100rel(invite)
        self._invite_cseq = invite.cseq[0]
        self._transaction = transaction
        self._build: BuildResponse | None = build
        self._timers = timers
        self._reliable_transport = reliable_transport
        self._on_prack_timeout: Callable[[], None] | None = on_prack_timeout
        self._rseq = secrets.randbelow(2**31 - 2)  # RFC 3262 §3: the first RSeq is anywhere in 1 .. 2**31 - 1
        self._unacked: ReliableProvisional | None = None
        self._unacked_has_sdp = False
        self._refresh: asyncio.TimerHandle | None = None

    @property
    def awaiting_prack_for_sdp(self) -> bool:
        """A reliable provisional with SDP awaits its PRACK: no 2xx may go yet (RFC 3262 §3)."""
        return self._unacked is not None and self._unacked_has_sdp

    def send(self, status: int, reason: str, sdp: str | None) -> None:
        headers: tuple[tuple[str, str], ...] = ()
        if self.reliable:
            if self._unacked is not None:
                return  # §3: no second reliable provisional before the first is acknowledged
            self._rseq += 1
            headers = (("Require", "100rel"), ("RSeq", str(self._rseq)))
        self._transaction.respond(self._build(status, reason, headers, sdp))
        if self.reliable:
            self._unacked = ReliableProvisional(self._rseq, self._transaction.retransmit, self._reliable_transport,
                                                self._timers, self._prack_timed_out)
            self._unacked_has_sdp = sdp is not None
        self._schedule_refresh()

    def on_prack(self, rack: str | None) -> bool:
        """A PRACK's RAck: True when it acknowledges our unacknowledged provisional (then 200, else 481)."""
        unacked = self._unacked
        if unacked is None or parse_rack(rack) != (unacked.rseq, self._invite_cseq, "INVITE"):
            return False
        unacked.stop()
        self._unacked = None
        return True

    def stop(self) -> None:
        """The final response goes: no more provisionals, resent or refreshed. The call's callbacks are let
        go, so the call and this object no longer hold each other: an ended call is freed at once by
        reference counting instead of waiting, with everything it holds, for a full cyclic GC (gc_pauses.py)."""
        if self._unacked is not None:
            self._unacked.stop()
            self._unacked = None
        if self._refresh is not None:
            self._refresh.cancel()
            self._refresh = None
        self._build = self._on_prack_timeout = None

    def _prack_timed_out(self) -> None:
        self._unacked = None
        self._on_prack_timeout()

    def _schedule_refresh(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        self._refresh = asyncio.get_running_loop().call_later(PROVISIONAL_REFRESH_S, self._refresh_now)

    def _refresh_now(self) -> None:
        """Unreliably the same provisional again; reliably a new one without SDP (the answer stands,
        RFC 6337 §3.1.1) once the previous one was PRACKed."""
        self._refresh = None
        if not self.reliable:
            self._transaction.retransmit()
            self._schedule_refresh()
        elif self._unacked is None:
            self.send(183, "Session Progress", None)
        else:
            self._schedule_refresh()


def wants_100rel(invite: SipRequest) -> bool:
    """RFC 3262 §3: whether our provisional responses to `invite` are sent reliably."""
    required = {item.strip().lower() for line in invite.header_lines("Require") for item in line.split(",")}
    return "100rel" in required or "100rel" in supported_options(invite)


def parse_rack(value: str | None) -> tuple[int, int, str] | None:
    """RAck (RFC 3262 §7.2): `response-num CSeq-num Method`; None when it does not parse."""
    parts = (value or "").split()
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit():
        return None
    return int(parts[0]), int(parts[1]), parts[2].upper()
