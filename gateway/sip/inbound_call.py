"""One inbound INVITE and the dialog it creates, as the call layer sees it (RFC 3261 §13-§15).

The call layer drives an `InboundCall` with reject/ring/accept/hangup and reads `events`: Confirmed
when the ACK for our 2xx arrives, then exactly one Ended. Here live the UAS core's duties for one
dialog: the 2xx retransmission until ACK (§13.3.1.4), answering re-INVITE/UPDATE offers, CANCEL and
BYE from the peer, and our own BYE. The `SipServer` (uas.py) owns transports and transactions and
lends each call the few things it needs as a `UasServices` given at construction; this module never
imports uas.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import structlog

from gateway.media.sdp import SdpError, check_offer
from gateway.sip.dialog import Dialog, new_tag
from gateway.sip.message import SipRequest, SipResponse, make_response
from gateway.sip.transaction import (
    AnswerRetransmission,
    InviteServerTransaction,
    ServerTransaction,
    Timers,
)
from gateway.sip.transport import Peer

log = structlog.get_logger(__name__)

ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS, INFO, UPDATE"
SDP_TYPE = "application/sdp"


@dataclass(frozen=True)
class Confirmed:
    """The ACK for our 2xx arrived: the dialog is confirmed."""


@dataclass(frozen=True)
class Ended:
    reason: str  # remote_bye | cancelled | ack_timeout | local_bye | bye_timeout | rejected


CallEvent = Confirmed | Ended


@dataclass(frozen=True)
class UasServices:
    """What the UAS core lends every call: its identity, its timers and the few operations a
    dialog needs from the server that owns the transports and transaction table."""

    user_agent: str
    retry_after_s: int
    timers: Timers
    contact_address: Callable[[Peer], tuple[str, int]]  # (host, port) we take requests at, per peer
    # A request inside the dialog (our BYE) -> its final response, None on timeout (§17.1.2).
    send_request: Callable[[SipRequest, str, str, int, Peer], Awaitable[SipResponse | None]]
    spawn: Callable[[Coroutine[Any, Any, None]], None]  # a task the server cancels when it stops
    forget: Callable[[InboundCall], None]  # the dialog is over: in-dialog requests now get 481


class InboundCall:
    """One INVITE and the dialog it creates, as seen by the call layer."""

    def __init__(self, services: UasServices, invite: SipRequest, transaction: InviteServerTransaction,
                 peer: Peer, received_at: float) -> None:
        self.call_id: str = invite.call_id or ""
        self.invite = invite
        self.request_user: str = _request_user(invite)
        self.remote_sdp: str | None = sdp_of(invite)
        self.source: tuple[str, int] = peer.address
        self.transport: str = peer.transport
        self.received_at = received_at
        self.events: asyncio.Queue[CallEvent] = asyncio.Queue()
        self.offer_handler: Callable[[str], str | None] | None = None
        self.dialog = Dialog(invite, new_tag())
        self._services = services
        self._transaction = transaction
        self._peer = peer
        self._state = "offered"  # offered -> accepted -> confirmed -> ending -> ended
        self.end_reason: str | None = None  # why the dialog ended (remote_bye, local_bye, rejected, ...), once it has
        self._hangup_pending = False
        self._local_sdp: str | None = None
        self._answer: AnswerRetransmission | None = None
        self._log = log.bind(call_id=self.call_id[:64])  # a peer chooses its length

    @property
    def ended(self) -> bool:
        return self._state == "ended"

    @property
    def retry_after_s(self) -> int:
        """The Retry-After a 503 for this call carries (RFC 3261 §20.33), from the SIP settings."""
        return self._services.retry_after_s

    # --- the call layer's controls -------------------------------------------------------------

    def reject(self, status: int, reason: str, headers: Mapping[str, str] | None = None) -> None:
        if not 300 <= status < 700:
            raise ValueError(f"reject needs a 3xx-6xx status, got {status}")
        if self._state != "offered":
            return
        self._transaction.respond(self._response(self.invite, status, reason, tuple((headers or {}).items())))
        self._end("rejected")

    def ring(self) -> None:
        if self._state == "offered":
            self._transaction.respond(self._response(self.invite, 180, "Ringing", self._contact()))

    def accept(self, sdp: str) -> None:
        if self._state != "offered":
            return
        self._local_sdp = sdp
        ok = self._answer_ok(self.invite, sdp)
        self._transaction.respond(ok)
        self._state = "accepted"
        self._expect_ack(self.invite.cseq[0], self._transaction)

    def hangup(self) -> None:
        if self._state == "offered":  # never answered: decline instead of a BYE (§15)
            self.reject(480, "Temporarily Unavailable")
        elif self._state == "accepted":
            self._hangup_pending = True  # §15: a UAS MUST NOT send BYE before the ACK (or its timeout)
        elif self._state == "confirmed":
            self._send_bye(end_reason=True)

    # --- driven by the server ------------------------------------------------------------------

    def answers(self, transaction: ServerTransaction) -> bool:
        """Whether `transaction` is this call's INVITE transaction (what a CANCEL names, §9.2)."""
        return transaction is self._transaction

    def stop_timers(self) -> None:
        """The server is stopping: no more 2xx retransmissions."""
        if self._answer is not None:
            self._answer.stop()

    def on_cancel(self) -> None:
        if self._state != "offered":
            return
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
            if self._hangup_pending:
                self._send_bye(end_reason=True)

    def on_request(self, request: SipRequest, transaction: ServerTransaction) -> None:
        """A request inside this dialog (its CSeq already accepted)."""
        method = request.method
        if method == "BYE":
            transaction.respond(self._response(request, 200, "OK"))
            self._log.info("sip_remote_bye")
            self._end("remote_bye")
        elif method in ("INVITE", "UPDATE"):
            self._on_offer(request, transaction)
        else:  # INFO (e.g. DTMF relays we do not use): acknowledge so the peer carries on
            transaction.respond(self._response(request, 200, "OK"))

    def _on_offer(self, request: SipRequest, transaction: ServerTransaction) -> None:
        """re-INVITE / UPDATE (RFC 3311): an SDP offer gets the call layer's answer or 488."""
        refusal = offer_refusal(request)
        if refusal is not None:
            status, detail = refusal
            reason = "Unsupported Media Type" if status == 415 else "Not Acceptable Here"
            warning = ("Warning", f'399 {self._services.user_agent} "{detail[:120]}"')
            transaction.respond(self._response(request, status, reason, (warning,)))
            return
        offer = sdp_of(request)
        if offer is None:
            if request.method == "UPDATE" or self._local_sdp is None:
                transaction.respond(self._response(request, 200, "OK", self._contact()))
                return
            answer: str | None = self._local_sdp  # offerless re-INVITE: our 2xx carries the offer
        else:
            answer = self.offer_handler(offer) if self.offer_handler is not None else None
        if answer is None:
            transaction.respond(self._response(request, 488, "Not Acceptable Here"))
            return
        self.dialog.refresh_target(request)
        self._local_sdp = answer
        ok = self._answer_ok(request, answer)
        transaction.respond(ok)
        if request.method == "INVITE":
            self._expect_ack(request.cseq[0], transaction)

    def _expect_ack(self, cseq: int, transaction: ServerTransaction) -> None:
        if self._answer is not None:
            self._answer.stop()
        self._answer = AnswerRetransmission(cseq, transaction.retransmit, self.transport == "tcp",
                                            self._services.timers, self._on_ack_timeout)

    def _on_ack_timeout(self) -> None:
        self._answer = None
        self._log.warning("sip_ack_timeout")
        self._end("ack_timeout")
        self._send_bye(end_reason=False)  # §13.3.1.4: the UAS SHOULD terminate the dialog with BYE

    def _send_bye(self, end_reason: bool) -> None:
        """Our BYE (§15.1.1). With `end_reason` the call ends when its transaction finishes."""
        if self._state == "ended" and end_reason:
            return
        if self._state != "ended":
            self._state = "ending"
        self._services.spawn(self._bye(end_reason))

    async def _bye(self, end_reason: bool) -> None:
        services = self._services
        host, port = services.contact_address(self._peer)
        via_host = f"[{host}]" if ":" in host else host
        request, hop = self.dialog.make_request("BYE", f"{via_host}:{port}", self.transport,
                                                services.user_agent)
        self._log.info("sip_bye_sent", to=request.uri)
        response: SipResponse | None = None
        try:
            response = await services.send_request(request, hop.transport, hop.host, hop.port, self._peer)
        except OSError as exc:
            self._log.warning("sip_bye_failed", error=repr(exc))
        if end_reason:
            self._end("local_bye" if response is not None else "bye_timeout")

    def _end(self, reason: str) -> None:
        if self._state == "ended":
            return
        self._state = "ended"
        if self._answer is not None:
            self._answer.stop()
            self._answer = None
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

    def _answer_ok(self, request: SipRequest, sdp: str) -> SipResponse:
        # §12.1.1: Record-Route copied into the 2xx in order; Contact names where we take requests.
        record_route = tuple(("Record-Route", value) for value in request.header_lines("Record-Route"))
        headers = (*record_route, *self._contact(), ("Allow", ALLOW), ("Supported", ""),
                   ("Server", self._services.user_agent))
        return make_response(request, 200, "OK", to_tag=self.dialog.local_tag, headers=headers,
                             body=sdp.encode(), content_type=SDP_TYPE)


def contact_value(host: str, port: int, transport: str) -> str:
    """The Contact URI for where we take requests (§8.1.1.8), IPv6 bracketed (RFC 3261 §25.1)."""
    host = f"[{host}]" if ":" in host else host
    suffix = ";transport=tcp" if transport == "tcp" else ""
    return f"<sip:{host}:{port}{suffix}>"


def _request_user(invite: SipRequest) -> str:
    try:
        return invite.request_user
    except ValueError:  # tel: or another scheme: the part before '@' or ';' is the number
        return invite.uri.partition(":")[2].split("@", 1)[0].split(";", 1)[0]


def sdp_of(request: SipRequest) -> str | None:
    content_type = (request.header("Content-Type") or "").split(";", 1)[0].strip().lower()
    if not request.body or content_type != SDP_TYPE:
        return None
    return request.body.decode("utf-8", "replace")


def offer_refusal(request: SipRequest) -> tuple[int, str] | None:
    """(status, reason) when the request's body is an offer we must refuse, else None."""
    if not request.body:
        return None
    content_type = (request.header("Content-Type") or "").split(";", 1)[0].strip().lower()
    if content_type != SDP_TYPE:
        return 415, f"body type {content_type[:40] or 'missing'!r} is not {SDP_TYPE}"
    try:
        check_offer(request.body.decode("utf-8"))
    except UnicodeDecodeError:
        return 488, "SDP is not valid UTF-8"
    except SdpError as exc:  # the reason goes into a Warning's quoted-string (§20.43)
        return 488, "".join(ch if ch.isprintable() and ch not in '"\\' else "?" for ch in str(exc))
    return None
