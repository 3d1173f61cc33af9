"""One inbound INVITE and the dialog it creates, as the call layer sees it (RFC 3261 §13-§15).

The call layer drives an `InboundCall` with reject/ring/progress/accept/hangup and reads `events`:
Confirmed when the ACK for our 2xx arrives, then exactly one Ended. Here live the UAS core's duties for
one dialog: early media (`progress`: 183 with the SDP answer, reliable with RSeq and resent until its
PRACK when the INVITE requires or supports 100rel, RFC 3262: provisional.py), the 2xx retransmission until ACK
(§13.3.1.4), answering re-INVITE/UPDATE offers (491/500 when they overlap, §14), session timers
(RFC 4028, numbers in session_timer.py, timers in session_refresh.py), CANCEL and BYE from the peer,
and our own BYE. The `SipServer` (uas.py) owns transports and transactions and
lends each call the few things it needs as a `UasServices` (uas_services.py) given at construction; this
module never imports uas.py. The header values and SDP checks it shares with uas.py are in uas_headers.py.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import structlog

from gateway.sip.dialog import Dialog, new_tag
from gateway.sip.message import SipRequest, SipResponse, make_response
from gateway.sip.provisional import Provisionals
from gateway.sip.session_refresh import SessionRefresh
from gateway.sip.session_timer import Agreement, SessionTimerSettings, TooSmall, negotiate
from gateway.sip.transaction import AnswerRetransmission, InviteServerTransaction, ServerTransaction
from gateway.sip.transport import Peer
from gateway.sip.uas_headers import (
    ALLOW,
    SDP_TYPE,
    SUPPORTED,
    allowed_methods,
    contact_value,
    offer_refusal,
    request_user,
    sdp_of,
)
from gateway.sip.uas_services import UasServices

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Confirmed:
    """The ACK for our 2xx arrived: the dialog is confirmed."""


@dataclass(frozen=True)
class Ended:
    # remote_bye | cancelled | ack_timeout | local_bye | bye_timeout | rejected | prack_timeout | session_expired
    reason: str


CallEvent = Confirmed | Ended


class InboundCall:
    """One INVITE and the dialog it creates, as seen by the call layer."""

    def __init__(self, services: UasServices, invite: SipRequest, transaction: InviteServerTransaction,
                 peer: Peer, received_at: float) -> None:
        self.call_id: str = invite.call_id or ""
        self.invite = invite
        self.request_user: str = request_user(invite)
        self.remote_sdp: str | None = sdp_of(invite)
        self.source: tuple[str, int] = peer.address
        self.transport: str = peer.transport
        self.received_at = received_at
        self.events: asyncio.Queue[CallEvent] = asyncio.Queue()
        self.confirmed = asyncio.Event()  # set with the Confirmed event: the ACK for our 2xx arrived
        self.offer_handler: Callable[[str], str | None] | None = None
        self.dialog = Dialog(invite, new_tag())
        self._provisionals = Provisionals(invite, transaction, self._provisional_response, services.timers,
                                          peer.transport == "tcp", self._on_prack_timeout)
        self._services = services
        self._transaction = transaction
        self._peer = peer
        self._state = "offered"  # offered -> early -> accepted -> confirmed -> ending -> ended
        self.end_reason: str | None = None  # why the dialog ended (remote_bye, local_bye, rejected, ...), once it has
        self._hangup_pending = False
        self._local_sdp: str | None = None
        self._answer: AnswerRetransmission | None = None
        self._deferred_ok: str | None = None  # accept() while a reliable 183 with SDP awaits its PRACK
        agreement = _agreement(invite, services.session_timers)
        self._timer_agreement: Agreement | None = agreement
        self._session_refresh: SessionRefresh | None = None
        self._invite_pending = False  # our own re-INVITE (a session refresh) awaits its final response
        self._log = log.bind(call_id=self.call_id[:64])  # a peer chooses its length

    @property
    def ended(self) -> bool:
        return self._state == "ended"

    @property
    def retry_after_s(self) -> int:
        """The Retry-After a 503 for this call carries (RFC 3261 §20.33), from the SIP settings."""
        return self._services.retry_after_s

    @property
    def reliable_provisionals(self) -> bool:
        """Whether our 18x go reliably (RFC 3262): the INVITE requires or supports 100rel."""
        return self._provisionals.reliable

    @property
    def session_timer(self) -> Agreement | None:
        """The session timer in force (RFC 4028), or None."""
        return self._timer_agreement

    # --- the call layer's controls -------------------------------------------------------------

    def reject(self, status: int, reason: str, headers: Mapping[str, str] | None = None,
               end_reason: str = "rejected") -> None:
        if not 300 <= status < 700:
            raise ValueError(f"reject needs a 3xx-6xx status, got {status}")
        if self._state not in ("offered", "early"):
            return
        self._stop_provisionals()
        self._transaction.respond(self._response(self.invite, status, reason, tuple((headers or {}).items())))
        self._end(end_reason)

    def ring(self) -> None:
        if self._state in ("offered", "early"):
            self._provisionals.send(180, "Ringing", None)

    def progress(self, sdp: str) -> None:
        """183 Session Progress carrying our SDP answer: RTP may flow before the 200 (early media, RFC 3960).
        Reliable (RSeq, resent until PRACK) when the INVITE requires or supports 100rel."""
        if self._state != "offered":
            return
        self._local_sdp = sdp
        self._state = "early"
        self._provisionals.send(183, "Session Progress", sdp)
        self._log.info("sip_early_media", reliable=self.reliable_provisionals)

    def accept(self, sdp: str) -> None:
        if self._state not in ("offered", "early"):
            return
        self._local_sdp = sdp
        if self._provisionals.awaiting_prack_for_sdp:
            # RFC 3262 §3: no 2xx before the PRACK of a reliable provisional that carried SDP.
            self._deferred_ok = sdp
            return
        self._stop_provisionals()
        ok = self._answer_ok(self.invite, sdp)
        self._transaction.respond(ok)
        self._state = "accepted"
        self._expect_ack(self.invite.cseq[0], self._transaction)
        if self._timer_agreement is not None:
            self._session_refresh = SessionRefresh(self._timer_agreement, self._send_refresh, self._expire,
                                                   self._services.spawn, self.call_id[:64])

    def hangup(self) -> None:
        if self._state in ("offered", "early"):  # never answered: decline instead of a BYE (§15)
            self.reject(480, "Temporarily Unavailable")
        elif self._state == "accepted":
            self._hangup_pending = True  # §15: a UAS MUST NOT send BYE before the ACK (or its timeout)
        elif self._state == "confirmed":
            self._send_bye(end_reason="local_bye")

    # --- driven by the server ------------------------------------------------------------------

    def answers(self, transaction: ServerTransaction) -> bool:
        """Whether `transaction` is this call's INVITE transaction (what a CANCEL names, §9.2)."""
        return transaction is self._transaction

    def stop_timers(self) -> None:
        """The server is stopping: no more retransmissions or refreshes."""
        if self._answer is not None:
            self._answer.stop()
        self._stop_provisionals()
        if self._session_refresh is not None:
            self._session_refresh.stop()

    def on_cancel(self) -> None:
        if self._state not in ("offered", "early"):
            return
        self._stop_provisionals()
        self._transaction.respond(self._response(self.invite, 487, "Request Terminated"))
        self._end("cancelled")

    def on_ack(self, ack: SipRequest) -> None:
        if self._answer is None or ack.cseq[0] != self._answer.cseq:
            return  # a retransmitted ACK, or one for an answer we no longer wait for
        self._answer.stop()
        self._answer = None
        if self._state == "accepted":
            self._state = "confirmed"
            self._log.info("sip_call_confirmed")
            self.events.put_nowait(Confirmed())
            self.confirmed.set()
            if self._hangup_pending:
                self._send_bye(end_reason="local_bye")

    def on_request(self, request: SipRequest, transaction: ServerTransaction) -> None:
        """A request inside this dialog (its CSeq already accepted)."""
        method = request.method
        if method == "BYE":
            transaction.respond(self._response(request, 200, "OK"))
            self._log.info("sip_remote_bye")
            if self._state in ("offered", "early"):  # §15.1.2: the caller left an early dialog
                self.reject(487, "Request Terminated", end_reason="remote_bye")
            self._end("remote_bye")
        elif method == "PRACK":
            self._on_prack(request, transaction)
        elif method in ("INVITE", "UPDATE"):
            if not self._overlapping(request, transaction):
                self._on_offer(request, transaction)
        else:  # INFO (e.g. DTMF relays we do not use): acknowledge so the peer carries on
            transaction.respond(self._response(request, 200, "OK"))

    def _on_prack(self, request: SipRequest, transaction: ServerTransaction) -> None:
        """RFC 3262 §3: a PRACK whose RAck names our unacknowledged reliable provisional gets 200; any
        other gets 481. A 2xx held back for it goes now."""
        if not self._provisionals.on_prack(request.header("RAck")):
            transaction.respond(self._response(request, 481, "Call/Transaction Does Not Exist"))
            return
        transaction.respond(self._response(request, 200, "OK"))
        self._log.info("sip_prack", rack=request.header("RAck"))
        if self._deferred_ok is not None:
            sdp, self._deferred_ok = self._deferred_ok, None
            self.accept(sdp)

    def _overlapping(self, request: SipRequest, transaction: ServerTransaction) -> bool:
        """RFC 3261 §14.2 / RFC 3311 §5.2: an offer while another offer-answer exchange is unfinished is
        refused: 500 with Retry-After while the INVITE itself is unanswered, 491 while our re-INVITE or
        our 2xx to theirs (awaiting its ACK) is pending. True when answered so."""
        if request.method == "INVITE" and self._state in ("offered", "early"):
            retry = ("Retry-After", str(random.randint(0, 10)))
            transaction.respond(self._response(request, 500, "Server Internal Error", (retry,)))
            return True
        has_offer = request.method == "INVITE" or bool(request.body)
        if has_offer and (self._invite_pending or (self._answer is not None and self._state != "early")):
            self._log.info("sip_request_pending", method=request.method)
            transaction.respond(self._response(request, 491, "Request Pending"))
            return True
        return False

    def _on_offer(self, request: SipRequest, transaction: ServerTransaction) -> None:
        """re-INVITE / UPDATE (RFC 3311): an SDP offer gets the call layer's answer or 488; once confirmed
        each is also a session refresh (RFC 4028 §9): 422 when its Session-Expires is too small."""
        refusal = offer_refusal(request)
        if refusal is not None:
            status, detail = refusal
            reason = "Unsupported Media Type" if status == 415 else "Not Acceptable Here"
            warning = ("Warning", f'399 {self._services.user_agent} "{detail[:120]}"')
            transaction.respond(self._response(request, status, reason, (warning,)))
            return
        agreement: Agreement | None = None
        if self._state in ("accepted", "confirmed"):
            try:
                timer = negotiate(request, self._services.session_timers)
            except ValueError as exc:
                transaction.respond(self._response(request, 400, "Bad Session-Expires",
                                                   (("Warning", f'399 {self._services.user_agent} "{exc}"'),)))
                return
            if isinstance(timer, TooSmall):
                transaction.respond(self._response(request, 422, "Session Interval Too Small",
                                                   timer.response_headers()))
                return
            agreement = timer
        offer = sdp_of(request)
        if offer is None:
            if request.method == "UPDATE" or self._local_sdp is None:
                timer_headers = agreement.response_headers() if agreement is not None else ()
                transaction.respond(self._response(request, 200, "OK", (*self._contact(), *timer_headers)))
                self._refreshed(agreement)
                return
            answer: str | None = self._local_sdp  # offerless re-INVITE: our 2xx carries the offer
        else:
            answer = self.offer_handler(offer) if self.offer_handler is not None else None
        if answer is None:
            transaction.respond(self._response(request, 488, "Not Acceptable Here"))
            return
        self.dialog.refresh_target(request)
        self._local_sdp = answer
        ok = self._answer_ok(request, answer, agreement)
        transaction.respond(ok)
        if request.method == "INVITE":
            self._expect_ack(request.cseq[0], transaction)
        self._refreshed(agreement)

    def _refreshed(self, agreement: Agreement | None) -> None:
        """Our 2xx to the peer's session refresh went out: the session timer starts again (RFC 4028 §10)."""
        if agreement is None:
            return
        self._timer_agreement = agreement
        if self._session_refresh is not None:
            self._session_refresh.restart(agreement)

    def _expect_ack(self, cseq: int, transaction: ServerTransaction) -> None:
        if self._answer is not None:
            self._answer.stop()
        self._answer = AnswerRetransmission(cseq, transaction.retransmit, self.transport == "tcp",
                                            self._services.timers, self._on_ack_timeout)

    def _on_ack_timeout(self) -> None:
        self._answer = None
        self._log.warning("sip_ack_timeout")
        self._end("ack_timeout")
        self._send_bye(end_reason=None)  # §13.3.1.4: the UAS SHOULD terminate the dialog with BYE

    # --- provisional responses (RFC 3262) -----------------------------------------------------------

    def _provisional_response(self, status: int, reason: str, headers: tuple[tuple[str, str], ...],
                              sdp: str | None) -> SipResponse:
        headers = (*self._contact(), ("Allow", ALLOW), ("Supported", SUPPORTED), *headers,
                   ("Server", self._services.user_agent))
        return make_response(self.invite, status, reason, to_tag=self.dialog.local_tag, headers=headers,
                             body=sdp.encode() if sdp is not None else b"",
                             content_type=SDP_TYPE if sdp is not None else None)

    def _on_prack_timeout(self) -> None:
        self._log.warning("sip_prack_timeout")
        # RFC 3262 §3: no PRACK within 64*T1: the UAS SHOULD reject the INVITE with a 5xx.
        warning = f'399 {self._services.user_agent} "no PRACK for the reliable provisional response"'
        self.reject(504, "Server Time-out", {"Warning": warning}, end_reason="prack_timeout")

    def _stop_provisionals(self) -> None:
        self._provisionals.stop()
        self._deferred_ok = None

    # --- requests we send ---------------------------------------------------------------------------

    def _via_sent_by(self) -> str:
        host, port = self._services.contact_address(self._peer)
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _send_refresh(self, agreement: Agreement) -> SipResponse | None:
        """RFC 4028 §7.4: our session refresh, an UPDATE without a body when the peer allows UPDATE,
        else a re-INVITE offering our SDP unchanged (same o= version: RFC 3264 §8, nothing renegotiates)."""
        if self._state != "confirmed" or self._invite_pending or self._local_sdp is None:
            return SipResponse(status=491, reason="Request Pending")  # try again shortly
        services = self._services
        headers = (*self._contact(), *agreement.request_headers(services.session_timers.min_se_s),
                   ("Allow", ALLOW))
        if "UPDATE" in allowed_methods(self.invite):
            request, hop = self.dialog.make_request("UPDATE", self._via_sent_by(), self.transport,
                                                    services.user_agent, headers)
            try:
                return await services.send_request(request, hop.transport, hop.host, hop.port, self._peer)
            except OSError as exc:
                self._log.warning("session_refresh_failed", error=repr(exc))
                return None
        request, hop = self.dialog.make_request("INVITE", self._via_sent_by(), self.transport,
                                                services.user_agent, headers)
        request = request.with_body(self._local_sdp.encode(), SDP_TYPE)
        self._invite_pending = True
        try:
            transaction = await services.send_invite(request, hop.transport, hop.host, hop.port, self._peer)
            response = await transaction.result
            if response is not None and 200 <= response.status < 300:
                ack, _ = self.dialog.make_request("ACK", self._via_sent_by(), self.transport, services.user_agent,
                                                  cseq=request.cseq[0])
                transaction.acknowledge_2xx(ack)
            return response
        except OSError as exc:
            self._log.warning("session_refresh_failed", error=repr(exc))
            return None
        finally:
            self._invite_pending = False

    def _expire(self) -> None:
        """The session timer ran out unrefreshed (RFC 4028 §10), or its refresh failed for good: BYE."""
        if self._state == "confirmed":
            self._send_bye(end_reason="session_expired")
        else:
            self.hangup()

    def _send_bye(self, end_reason: str | None) -> None:
        """Our BYE (§15.1.1). With an `end_reason` the call ends with it once the BYE's transaction finishes."""
        if self._state == "ended" and end_reason is not None:
            return
        if self._state != "ended":
            self._state = "ending"
        if self._session_refresh is not None:
            self._session_refresh.stop()
        self._services.spawn(self._bye(end_reason))

    async def _bye(self, end_reason: str | None) -> None:
        services = self._services
        request, hop = self.dialog.make_request("BYE", self._via_sent_by(), self.transport, services.user_agent)
        self._log.info("sip_bye_sent", to=request.uri)
        response: SipResponse | None = None
        try:
            response = await services.send_request(request, hop.transport, hop.host, hop.port, self._peer)
        except OSError as exc:
            self._log.warning("sip_bye_failed", error=repr(exc))
        if end_reason is not None:
            self._end(end_reason if response is not None or end_reason != "local_bye" else "bye_timeout")

    def _end(self, reason: str) -> None:
        if self._state == "ended":
            return
        self._state = "ended"
        if self._answer is not None:
            self._answer.stop()
            self._answer = None
        self._stop_provisionals()
        if self._session_refresh is not None:
            self._session_refresh.stop()
        # The session timer's callbacks and the call layer's offer handler (which holds its media) point back
        # at this call: let them go, so the ended call is freed by reference counting, not by a full cyclic
        # GC that would also walk every live call (gateway/gc_pauses.py).
        self._session_refresh = None
        self.offer_handler = None
        self.end_reason = reason  # logged by the call layer's call_ended, with the session's outcome
        self.events.put_nowait(Ended(reason))
        self._services.forget(self)

    # --- responses ------------------------------------------------------------------------------

    def _response(self, request: SipRequest, status: int, reason: str,
                  headers: tuple[tuple[str, str], ...] = ()) -> SipResponse:
        return make_response(request, status, reason, to_tag=self.dialog.local_tag,
                             headers=(*headers, ("Server", self._services.user_agent)))

    def _contact(self) -> tuple[tuple[str, str], ...]:
        return (("Contact", contact_value(*self._services.contact_address(self._peer), self.transport)),)

    def _answer_ok(self, request: SipRequest, sdp: str, agreement: Agreement | None = None) -> SipResponse:
        # §12.1.1: Record-Route copied into the 2xx in order; Contact names where we take requests.
        record_route = tuple(("Record-Route", value) for value in request.header_lines("Record-Route"))
        if request is self.invite:
            agreement = self._timer_agreement
        timer = agreement.response_headers() if agreement is not None else ()
        headers = (*record_route, *self._contact(), ("Allow", ALLOW), ("Supported", SUPPORTED), *timer,
                   ("Server", self._services.user_agent))
        return make_response(request, 200, "OK", to_tag=self.dialog.local_tag, headers=headers,
                             body=sdp.encode(), content_type=SDP_TYPE)


def _agreement(invite: SipRequest, settings: SessionTimerSettings) -> Agreement | None:
    """The INVITE's session timer; the server answered 422 or 400 already for one we could not take."""
    try:
        timer = negotiate(invite, settings)
    except ValueError:
        return None
    return timer if isinstance(timer, Agreement) else None
