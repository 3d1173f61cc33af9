"""The SIP user-agent server core (RFC 3261 §8.2, §12-§15): admits INVITEs and runs their dialogs.

`SipServer` receives every message from the transport, applies the edge policy (before parsing, the
gate of gate.py: a source outside the allow-list -> a few cheap 403s, the rest dropped; the flood budgets
of rate_limit.py -> cheap 503 or drop, requests of live calls exempt; then parse errors -> 400/505,
Max-Forwards 0 -> 483, unknown URI scheme -> 416, merged request -> 482, bad SDP offer -> 488/415,
capacity and draining -> 503), hands requests to transactions (bound to the transport by
transaction_sender.py) and answers each method. Each new INVITE becomes an `InboundCall` (inbound_call.py) that
the call layer drives; every name the call layer uses is importable from this module.

This module never touches media or speech: SDP is only checked (media/sdp.py) so a malformed offer
is refused here, before the call layer sees it, and passed through as text.

Log and metric hygiene: label values come from bounded sets (metrics.sip_method_label); peer-chosen
strings in log lines are cut to `_LOG_FIELD_CHARS`; events a flood repeats (malformed messages, 503s)
go through a `LogBudget` (log_budget.py): a few lines a second, the rest summed into one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from gateway import metrics
from gateway.config_errors import ConfigError
from gateway.sip.dialog import DialogKey, new_tag
from gateway.sip.edge_replies import malformed_reply, stamp_via, warning
from gateway.sip.inbound_call import CallEvent, Confirmed, Ended, InboundCall
from gateway.sip.log_budget import LogBudget
from gateway.sip.message import (
    ParseError,
    SipRequest,
    SipResponse,
    make_response,
    parse,
)
from gateway.sip.gate import PreParseGate
from gateway.sip.rate_limit import FloodLimits
from gateway.sip.session_timer import SessionTimerSettings, TooSmall, negotiate
from gateway.sip.transaction import (
    InviteServerTransaction,
    ServerTransaction,
    Timers,
    TransactionTable,
    server_key,
)
from gateway.sip.transaction_sender import TransactionSender
from gateway.sip.transport import Peer, SipTransport, StreamLimits, advertised_host_for
from gateway.sip.uas_headers import (
    ALLOW,
    SDP_TYPE,
    SUPPORTED,
    contact_value,
    offer_refusal,
    unsupported_extensions,
)
from gateway.sip.uas_services import UasServices

__all__ = ["CallEvent", "Confirmed", "Ended", "InboundCall", "SipServer", "SipSettings"]

log = structlog.get_logger(__name__)

_NOT_ALLOWED = frozenset({"REGISTER", "SUBSCRIBE", "MESSAGE", "PUBLISH", "NOTIFY", "REFER"})
_IMPLEMENTED = frozenset({"INVITE", "ACK", "CANCEL", "BYE", "OPTIONS", "INFO", "UPDATE", "PRACK"})
_URI_SCHEMES = ("sip:", "sips:", "tel:")  # §8.2.2.1: anything else is 416
_LOG_FIELD_CHARS = 64  # Call-IDs, reasons and addresses a peer chose, as they appear in logs
_SWEEP_S = 1.0  # how often ended flood episodes and suppressed log lines are reported


@dataclass(frozen=True)
class SipSettings:
    listen_host: str = "127.0.0.1"
    listen_port: int = 5060
    transports: tuple[str, ...] = ("udp", "tcp")
    allowed_sources: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()  # empty = all
    max_calls: int = 500
    retry_after_s: int = 5
    t1: float = 0.5
    t2: float = 4.0
    t4: float = 5.0
    user_agent: str = "cosyvoice-gateway"
    advertised_host: str | None = None  # host for Contact/SDP if different from listen_host
    stream_limits: StreamLimits = field(default_factory=StreamLimits)
    flood: FloodLimits = field(default_factory=FloodLimits)  # budgets before parsing (rate_limit.py)
    session_timers: SessionTimerSettings = field(default_factory=SessionTimerSettings)  # RFC 4028


class SipServer:
    """`on_invite` takes each admitted call; if it returns a future (the call layer's task), the call
    counts against `max_calls` until both its dialog and that future are done, so a session still
    closing its media after the BYE is not replaced by a 51st call."""

    def __init__(self, settings: SipSettings, on_invite: Callable[[InboundCall], object],
                 refusal: Callable[[], str | None] = lambda: None,
                 invite_refusal: Callable[[], str | None] | None = None) -> None:
        self.settings = settings
        self.draining = False
        self._refusal = refusal  # why new calls are turned away now (engine down or full), or None
        # An INVITE's own check, where it differs: with the prompt cache a full engine is no reason to refuse
        # at the edge (a hit takes no engine slot; a miss is refused 503 by the call session).
        self._invite_refusal = invite_refusal or refusal
        self.udp_address: tuple[str, int] | None = None
        self.tcp_address: tuple[str, int] | None = None
        self._on_invite = on_invite
        self._timers = Timers(settings.t1, settings.t2, settings.t4)
        self._transport = SipTransport(settings.listen_host, settings.listen_port, settings.transports,
                                       self._on_message, self._on_stream_error, settings.stream_limits,
                                       self._connection_allowed, self._within_budget)
        self._transactions = TransactionTable()
        self._sender = TransactionSender(self._transport, self._transactions, self._timers)
        self._gate = PreParseGate(settings.flood, settings.retry_after_s, self._address_allowed,
                                  self._transactions.has_branch, self._send_cheap)
        self._calls: dict[DialogKey, InboundCall] = {}
        self._admitted: set[InboundCall] = set()  # counted against max_calls (see the class docstring)
        self._owners: dict[InboundCall, asyncio.Future] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._sweeper: asyncio.TimerHandle | None = None
        self._sparse_log = LogBudget(log)
        self._services = UasServices(settings.user_agent, settings.retry_after_s, self._timers,
                                     self._contact_address, self._sender.send_request, self._sender.send_invite,
                                     self._spawn, self._forget, settings.session_timers)

    @property
    def active_calls(self) -> int:
        """Admitted calls whose dialog or call-layer task is not over yet: what `max_calls` bounds."""
        return len(self._admitted)

    async def start(self) -> None:
        try:
            await self._transport.start()
        except OSError as exc:  # in use, or not an address of this host: the operator's to fix (exit 2)
            where = f"{self.settings.listen_host}:{self.settings.listen_port}"
            raise ConfigError([f"sip.listen: cannot listen on {where} "
                               f"({'/'.join(self.settings.transports)}): {exc.strerror or exc}"]) from None
        self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)
        self.udp_address = self._transport.udp_address
        self.tcp_address = self._transport.tcp_address
        log.info("sip_listening", udp=self.udp_address, tcp=self.tcp_address)

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._transactions.close()
        for call in list(self._calls.values()):
            call.stop_timers()
        await self._transport.stop()

    # --- receiving ------------------------------------------------------------------------------

    def _on_message(self, data: bytes, peer: Peer) -> None:
        if not self._gate.admit(data, peer):  # before parsing: allow-list and flood budgets (gate.py)
            return
        try:
            message = parse(data, stream=peer.transport == "tcp")
        except ParseError as exc:
            metrics.sip_malformed_total.inc()
            self._sparse_log.info("sip_malformed", reason=exc.reason[:120], source=_short(peer.address[0]),
                                transport=peer.transport)
            self._answer_malformed(exc, peer)
            return
        if isinstance(message, SipResponse):
            transaction = self._transactions.match_client(message)
            if transaction is not None:
                transaction.on_response(message)
            return
        self._on_request(message, peer)

    def _answer_malformed(self, error: ParseError, peer: Peer) -> None:
        """§21.4.1: 400 (414 for a Request-URI too long, §21.4.12; 505 for another SIP version,
        §21.5.6) when the request names where a response goes (a usable Via); else drop."""
        if not self._address_allowed(peer.address[0]):
            return  # no answer to strangers' garbage: it only tells a scanner that we are here
        response = malformed_reply(error.partial, peer.address, error.status, error.reason, self.settings.user_agent)
        if response is not None:
            metrics.sip_responses_total.labels(code=str(response.status)).inc()
            self._sender.response_sender(response, peer)()

    def _on_stream_error(self, head: bytes, peer: Peer, status: int, reason: str) -> None:
        """TCP framing failed (§18.3): answer what the header block allows, then the connection closes."""
        metrics.sip_malformed_total.inc()
        self._sparse_log.info("sip_malformed", reason=reason[:120], source=_short(peer.address[0]), transport="tcp")
        try:
            request = parse(head, stream=False)
        except ParseError as exc:  # the body is not there, so the Content-Length never matches
            request = exc.partial
        response = malformed_reply(request, peer.address, status, reason, self.settings.user_agent)
        if response is not None:
            metrics.sip_responses_total.labels(code=str(status)).inc()
            self._sender.response_sender(response, peer)()

    def _on_request(self, request: SipRequest, peer: Peer) -> None:
        request = stamp_via(request, peer.address)
        existing = self._transactions.server.get(server_key(request))
        if existing is not None and existing.on_retransmission(request):
            return
        if not self._address_allowed(peer.address[0]) and not self._in_live_dialog(request):
            if request.method != "ACK":
                self._sender.new_server(request, peer).respond(self._simple(request, 403, "Forbidden"))
            return
        metrics.sip_requests_total.labels(method=metrics.sip_method_label(request.method)).inc()
        if request.method == "ACK":
            self._on_ack(request)
            return
        transaction = self._sender.new_server(request, peer)
        try:
            self._dispatch(request, transaction, peer)
        except Exception:  # a bug in one request's handling must not stop the server
            log.exception("sip_request_failed", call_id=_short(request.call_id),
                          method=metrics.sip_method_label(request.method))
            if not transaction.final_sent:
                transaction.respond(self._simple(request, 500, "Server Internal Error"))

    def _dispatch(self, request: SipRequest, transaction: ServerTransaction, peer: Peer) -> None:
        method = request.method
        max_forwards = request.header("Max-Forwards")
        if max_forwards is not None and int(max_forwards) == 0:
            transaction.respond(self._simple(request, 483, "Too Many Hops"))
        elif method in _NOT_ALLOWED:
            transaction.respond(self._simple(request, 405, "Method Not Allowed", (("Allow", ALLOW),)))
        elif method not in _IMPLEMENTED:
            transaction.respond(self._simple(request, 501, "Not Implemented", (("Allow", ALLOW),)))
        elif not request.uri.lower().startswith(_URI_SCHEMES):
            transaction.respond(self._simple(request, 416, "Unsupported URI Scheme"))
        elif request.to_tag is None and self._transactions.merged_with(transaction) is not None:
            # §8.2.2.2: the same request reached us twice by different paths (a forking proxy).
            transaction.respond(self._simple(request, 482, "Loop Detected"))
        elif method == "CANCEL":
            self._on_cancel(request, transaction)
        elif method == "OPTIONS":  # qualify pings (Kamailio/Asterisk), in or out of a dialog
            headers = (("Allow", ALLOW), ("Accept", SDP_TYPE), ("Supported", SUPPORTED),
                       ("Contact", contact_value(*self._contact_address(peer), peer.transport)))
            if request.to_tag is None and self.why_refused() is not None:
                # Out of dialog, a qualify ping: 503 while we would refuse an INVITE, so the proxy
                # (Kamailio dispatcher, Asterisk qualify) marks us down and routes elsewhere.
                retry = (("Retry-After", str(self.settings.retry_after_s)),)
                transaction.respond(self._simple(request, 503, "Service Unavailable", (*headers, *retry)))
            else:
                transaction.respond(self._simple(request, 200, "OK", headers))
        elif unsupported_extensions(request) and method != "BYE":
            # §8.2.2.3: 420 naming what we lack; 100rel and timer we serve; BYE is exempt so a call can always end.
            unsupported = ", ".join(unsupported_extensions(request))
            transaction.respond(self._simple(request, 420, "Bad Extension", (("Unsupported", unsupported),)))
        elif request.to_tag is not None:
            self._on_in_dialog(request, transaction)
        elif method == "INVITE":
            assert isinstance(transaction, InviteServerTransaction)
            if self._offer_acceptable(request, transaction) and self._session_timer_acceptable(request, transaction):
                self._on_new_invite(request, transaction, peer)
        else:  # BYE/INFO/UPDATE outside any dialog
            transaction.respond(self._simple(request, 481, "Call/Transaction Does Not Exist"))

    def _offer_acceptable(self, request: SipRequest, transaction: ServerTransaction) -> bool:
        """An offer we cannot use is refused before the call layer sees it: 415 for a body that is
        not SDP (§8.2.3), 488 with the reason in a Warning for broken SDP (§21.4.26)."""
        refusal = offer_refusal(request)
        if refusal is None:
            return True
        status, detail = refusal
        headers = (("Accept", SDP_TYPE),) if status == 415 else ()
        reason = "Unsupported Media Type" if status == 415 else "Not Acceptable Here"
        refused = warning(self.settings.user_agent, detail)
        transaction.respond(self._simple(request, status, reason, (*headers, refused)))
        self._sparse_log.info("sip_offer_refused", call_id=_short(request.call_id), status=status,
                            detail=detail[:120])
        return False

    def _session_timer_acceptable(self, request: SipRequest, transaction: ServerTransaction) -> bool:
        """RFC 4028 §8.1: a Session-Expires below our minimum gets 422 with our Min-SE, before admission;
        one that does not parse gets 400."""
        try:
            timer = negotiate(request, self.settings.session_timers)
        except ValueError as exc:
            transaction.respond(self._simple(request, 400, "Bad Session-Expires",
                                             (warning(self.settings.user_agent, str(exc)),)))
            return False
        if isinstance(timer, TooSmall):
            transaction.respond(self._simple(request, 422, "Session Interval Too Small", timer.response_headers()))
            return False
        return True

    def _on_new_invite(self, invite: SipRequest, transaction: InviteServerTransaction, peer: Peer) -> None:
        received_at = time.monotonic()
        refusal = self.why_refused(invite=True)
        if refusal is not None:
            retry = (("Retry-After", str(self.settings.retry_after_s)),)
            transaction.respond(self._simple(invite, 503, "Service Unavailable", retry))
            metrics.calls_refused_total.labels(reason=refusal.partition(":")[0]).inc()
            self._sparse_log.info("sip_invite_refused", call_id=_short(invite.call_id), refusal=refusal,
                                  active_calls=len(self._admitted))
            return
        transaction.respond(self._simple(invite, 100, "Trying"))  # §17.2.1: stop INVITE retransmits
        call = InboundCall(self._services, invite, transaction, peer, received_at)
        self._calls[call.dialog.key] = call
        self._admitted.add(call)  # in the same step as the max_calls check: nothing runs in between
        self._gate.call_started(call.call_id)
        log.info("sip_invite", call_id=_short(call.call_id), user=_short(call.request_user),
                 transport=peer.transport, source=f"{peer.address[0]}:{peer.address[1]}")
        try:
            owner = self._on_invite(call)
        except Exception:
            log.exception("sip_on_invite_failed", call_id=_short(call.call_id))
            call.reject(500, "Server Internal Error")
            return
        if isinstance(owner, asyncio.Future) and not owner.done():
            self._owners[call] = owner
            owner.add_done_callback(lambda _: self._owned_call_done(call))

    def why_refused(self, invite: bool = False) -> str | None:
        """Why a new INVITE gets 503 now (draining, max_calls, engine down or full), or None; an
        out-of-dialog OPTIONS gets the same 503, so a proxy stops sending what we would refuse, and the
        gateway's /healthz asks the same question (gateway.app.Gateway.status), so the two never disagree."""
        if self.draining:
            return "draining"
        if len(self._admitted) >= self.settings.max_calls:
            return "max_calls"
        return self._invite_refusal() if invite else self._refusal()

    def _on_cancel(self, cancel: SipRequest, transaction: ServerTransaction) -> None:
        """§9.2: CANCEL matches the INVITE's transaction; 200 to the CANCEL, 487 to the INVITE."""
        invite_transaction = self._transactions.server.get(server_key(cancel, "INVITE"))
        if invite_transaction is None:
            transaction.respond(self._simple(cancel, 481, "Call/Transaction Does Not Exist"))
            return
        call = next((c for c in self._calls.values() if c.answers(invite_transaction)), None)
        # §9.2: the 200 to the CANCEL SHOULD carry the same To tag as the INVITE's responses.
        tag = call.dialog.local_tag if call is not None else new_tag()
        transaction.respond(make_response(cancel, 200, "OK", to_tag=tag,
                                          headers=(("Server", self.settings.user_agent),)))
        if call is not None:
            call.on_cancel()

    def _on_in_dialog(self, request: SipRequest, transaction: ServerTransaction) -> None:
        call = self._calls.get((request.call_id or "", request.to_tag or "", request.from_tag))
        if call is None:
            transaction.respond(self._simple(request, 481, "Call/Transaction Does Not Exist"))
        elif not call.dialog.accept_sequence(request):
            transaction.respond(self._simple(request, 500, "Server Internal Error",
                                             (("Warning", '399 - "CSeq out of order"'),)))
        else:
            call.on_request(request, transaction)

    def _in_live_dialog(self, request: SipRequest) -> bool:
        """Whether `request` belongs to a call admitted earlier: a request inside one of its dialogs, or the
        CANCEL of its pending INVITE. Those are never re-judged by the allow-list: after a trunk reload
        removed its address, a live call must still be able to hang up (§15) or be cancelled (§9)."""
        if request.to_tag is not None:
            return (request.call_id or "", request.to_tag, request.from_tag) in self._calls
        if request.method == "CANCEL":
            return self._transactions.server.get(server_key(request, "INVITE")) is not None
        return False

    def _on_ack(self, ack: SipRequest) -> None:
        call = self._calls.get((ack.call_id or "", ack.to_tag or "", ack.from_tag))
        if call is not None:
            call.on_ack(ack)

    def _within_budget(self, source: str, cost: int) -> bool:
        return self._gate.within_budget(source, cost)

    def _send_cheap(self, response: bytes, peer: Peer) -> None:
        self._transport.send(response, peer.transport, peer.address, peer.connection)

    def _connection_allowed(self, host: str) -> bool:
        """A TCP connection at accept; one from outside the trunks is closed and its source logged (gate.py)."""
        allowed = self._address_allowed(host)
        if not allowed:
            self._gate.connection_refused(host)
        return allowed

    def _address_allowed(self, host: str) -> bool:
        if not self.settings.allowed_sources:
            return True
        address = ipaddress.ip_address(host.split("%", 1)[0])
        return any(address in network for network in self.settings.allowed_sources)

    # --- once a second: log budget and flood episodes --------------------------------------------------------

    def _sweep(self) -> None:
        self._sweeper = asyncio.get_running_loop().call_later(_SWEEP_S, self._sweep)
        self._sparse_log.roll()
        self._gate.sweep()

    # --- sending --------------------------------------------------------------------------------

    def _simple(self, request: SipRequest, status: int, reason: str,
                headers: tuple[tuple[str, str], ...] = ()) -> SipResponse:
        to_tag = None if status == 100 else new_tag()
        return make_response(request, status, reason, to_tag=to_tag,
                             headers=(*headers, ("Server", self.settings.user_agent)))

    def _contact_address(self, peer: Peer) -> tuple[str, int]:
        bound = self.tcp_address if peer.transport == "tcp" else self.udp_address
        port = bound[1] if bound else self.settings.listen_port
        host = self.settings.advertised_host or self.settings.listen_host
        return advertised_host_for(host, peer.address[0]), port

    def _forget(self, call: InboundCall) -> None:
        if self._calls.get(call.dialog.key) is call:
            del self._calls[call.dialog.key]
            self._gate.call_ended(call.call_id)
        if call not in self._owners:
            self._admitted.discard(call)

    def _owned_call_done(self, call: InboundCall) -> None:
        del self._owners[call]
        if self._calls.get(call.dialog.key) is not call:  # its dialog is over too
            self._admitted.discard(call)

    def _spawn(self, coroutine) -> None:
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _short(value: str | None) -> str | None:
    return value if value is None or len(value) <= _LOG_FIELD_CHARS else value[:_LOG_FIELD_CHARS] + "..."

