"""SIP transactions (RFC 3261 §17): the state machines that absorb retransmissions and own timers.

Server transactions (§17.2) resend their last response when a request is retransmitted; the
INVITE server transaction also retransmits a non-2xx final response until the ACK (Timers G/H/I)
and, per RFC 6026 §7.1, stays "Accepted" after a 2xx so retransmitted INVITEs are absorbed while
the UAS core retransmits the 2xx itself. The non-INVITE client transaction (§17.1.2) carries the
BYE and UPDATE we send (Timers E/F/K), the INVITE client transaction our session-refresh re-INVITE
(Timers A/B/D). `ReliableProvisional` resends a 100rel provisional until its PRACK (RFC 3262 §3). Timers only run over UDP where retransmission is needed (§17.1.2.2).

Sending is injected as a callable so this module has no sockets; timers use the event loop clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from gateway import metrics
from gateway.sip.message import SipRequest, SipResponse

MAGIC_COOKIE = "z9hG4bK"  # §8.1.1.7: branch of an RFC 3261 compliant client

TransactionKey = tuple


@dataclass(frozen=True)
class Timers:
    """§17.1.1.1 base values: T1 RTT estimate, T2 max non-INVITE retransmit interval, T4 max
    lifetime of a message in the network. Tests shrink T1 to keep 64*T1 short."""

    t1: float = 0.5
    t2: float = 4.0
    t4: float = 5.0


def server_key(request: SipRequest, method: str | None = None) -> TransactionKey:
    """§17.2.3 matching: branch + sent-by + method, ACK matching its INVITE. `method` overrides
    the request's own (a CANCEL looks up the INVITE it cancels, §9.2)."""
    via = request.vias[0]
    method = method or ("INVITE" if request.method == "ACK" else request.method)
    branch = via.branch or ""
    if branch.startswith(MAGIC_COOKIE):
        return (branch, via.sent_by.lower(), method)
    # Pre-RFC 3261 peers: the request's identifying fields stand in for a branch.
    return (request.call_id, request.from_tag, request.cseq[0], method, str(via))


class _TimerOwner:
    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._handles: dict[str, asyncio.TimerHandle] = {}

    def _start_timer(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        self._stop_timer(name)
        self._handles[name] = self._loop.call_later(delay, callback)

    def _stop_timer(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.cancel()

    def _stop_all(self) -> None:
        for handle in self._handles.values():
            handle.cancel()
        self._handles.clear()


class ServerTransaction(_TimerOwner):
    """Common part: the request, how to send a response to its origin, the last response sent."""

    def __init__(self, request: SipRequest, send: Callable[[SipResponse], None], reliable: bool,
                 timers: Timers, on_terminated: Callable[[ServerTransaction], None]) -> None:
        super().__init__()
        self.request = request
        self.key = server_key(request)
        self.state = "trying"
        self.last_response: SipResponse | None = None
        self._send = send
        self._reliable = reliable
        self._timers = timers
        self._on_terminated = on_terminated

    @property
    def final_sent(self) -> bool:
        return self.last_response is not None and self.last_response.status >= 200

    def _transmit(self, response: SipResponse) -> None:
        self.last_response = response
        metrics.sip_responses_total.labels(code=str(response.status)).inc()
        self._send(response)

    def retransmit(self) -> None:
        """Send the last response again (the UAS core's 2xx retransmission uses this too)."""
        if self.last_response is not None:
            self._send(self.last_response)

    def _terminate(self) -> None:
        if self.state != "terminated":
            self.state = "terminated"
            self._stop_all()
            self._on_terminated(self)

    def respond(self, response: SipResponse) -> None:
        raise NotImplementedError

    def on_retransmission(self, request: SipRequest) -> bool:
        """A request matched this transaction; True if absorbed here, False if the core must see it."""
        raise NotImplementedError


class InviteServerTransaction(ServerTransaction):
    """§17.2.1 (with RFC 6026's Accepted state)."""

    def respond(self, response: SipResponse) -> None:
        if self.state not in ("trying", "proceeding"):
            return  # a final response was already sent; a second one is a TU bug we ignore
        self._transmit(response)
        if response.status < 200:
            self.state = "proceeding"
        elif response.status < 300:
            self.state = "accepted"  # RFC 6026 §7.1: Timer L keeps absorbing INVITE retransmissions
            self._start_timer("L", 64 * self._timers.t1, self._terminate)
        else:
            self.state = "completed"
            if not self._reliable:
                self._start_timer("G", self._timers.t1, lambda: self._timer_g(self._timers.t1))
            self._start_timer("H", 64 * self._timers.t1, self._terminate)

    def _timer_g(self, interval: float) -> None:
        self.retransmit()
        interval = min(2 * interval, self._timers.t2)
        self._start_timer("G", interval, lambda: self._timer_g(interval))

    def on_retransmission(self, request: SipRequest) -> bool:
        if request.method == "ACK":
            if self.state == "completed":
                self.state = "confirmed"
                self._stop_timer("G")
                self._stop_timer("H")
                self._start_timer("I", 0 if self._reliable else self._timers.t4, self._terminate)
                return True
            # An ACK for our 2xx that reuses the INVITE's branch goes to the core (RFC 6026 §7.1).
            return self.state != "accepted"
        if self.state in ("trying", "proceeding", "completed"):
            self.retransmit()  # §17.2.1: retransmitted INVITE -> last provisional/final response again
        return True


class NonInviteServerTransaction(ServerTransaction):
    """§17.2.2."""

    def respond(self, response: SipResponse) -> None:
        if self.state in ("completed", "terminated"):
            return
        self._transmit(response)
        if response.status < 200:
            self.state = "proceeding"
            return
        self.state = "completed"
        self._start_timer("J", 0 if self._reliable else 64 * self._timers.t1, self._terminate)

    def on_retransmission(self, request: SipRequest) -> bool:
        if self.state in ("proceeding", "completed"):
            self.retransmit()
        return True


class ClientTransaction(_TimerOwner):
    """Common part of our requests' transactions: matched by branch and method (§17.1.3); `result`
    resolves to the final response, or None on timeout."""

    first_state = "trying"

    def __init__(self, request: SipRequest, send: Callable[[bytes], None], reliable: bool,
                 timers: Timers, on_terminated: Callable[[ClientTransaction], None]) -> None:
        super().__init__()
        self.request = request
        self.key: TransactionKey = (request.vias[0].branch, request.method)
        self.state = self.first_state
        self.result: asyncio.Future[SipResponse | None] = self._loop.create_future()
        self._data = request.serialize()
        self._send = send
        self._reliable = reliable
        self._timers = timers
        self._on_terminated = on_terminated

    def start(self) -> None:
        raise NotImplementedError

    def on_response(self, response: SipResponse) -> None:
        raise NotImplementedError


class NonInviteClientTransaction(ClientTransaction):
    """§17.1.2: our BYE and UPDATE (Timers E/F/K)."""

    def start(self) -> None:
        self._send(self._data)
        if not self._reliable:
            self._start_timer("E", self._timers.t1, lambda: self._timer_e(self._timers.t1))
        self._start_timer("F", 64 * self._timers.t1, self._timer_f)

    def _timer_e(self, interval: float) -> None:
        self._send(self._data)
        # §17.1.2.2: doubling up to T2 while Trying; every T2 once a provisional arrived.
        interval = self._timers.t2 if self.state == "proceeding" else min(2 * interval, self._timers.t2)
        self._start_timer("E", interval, lambda: self._timer_e(interval))

    def _timer_f(self) -> None:
        self._finish(None)

    def on_response(self, response: SipResponse) -> None:
        if self.state not in ("trying", "proceeding"):
            return  # retransmitted final response, absorbed in Completed
        if response.status < 200:
            self.state = "proceeding"
            return
        self.state = "completed"
        self._stop_timer("E")
        self._stop_timer("F")
        if not self.result.done():
            self.result.set_result(response)
        self._start_timer("K", 0 if self._reliable else self._timers.t4, lambda: self._finish(response))

    def _finish(self, response: SipResponse | None) -> None:
        self.state = "terminated"
        self._stop_all()
        if not self.result.done():
            self.result.set_result(response)
        self._on_terminated(self)


class AnswerRetransmission(_TimerOwner):
    """§13.3.1.4: the UAS core resends its 2xx to an INVITE at T1, 2*T1, ... capped at T2 until the
    ACK arrives; after 64*T1 without one it gives up (`on_give_up`). Over TCP nothing is resent
    (the transport is reliable) but the 64*T1 deadline still applies."""

    def __init__(self, cseq: int, resend: Callable[[], None], reliable: bool, timers: Timers,
                 on_give_up: Callable[[], None]) -> None:
        super().__init__()
        self.cseq = cseq
        self._resend = resend
        self._timers = timers
        if not reliable:
            self._start_timer("resend", timers.t1, lambda: self._tick(timers.t1))
        self._start_timer("give_up", 64 * timers.t1, self._give_up(on_give_up))

    def _tick(self, interval: float) -> None:
        self._resend()
        interval = min(2 * interval, self._timers.t2)
        self._start_timer("resend", interval, lambda: self._tick(interval))

    def _give_up(self, on_give_up: Callable[[], None]) -> Callable[[], None]:
        def fire() -> None:
            self._stop_all()
            on_give_up()

        return fire

    def stop(self) -> None:
        self._stop_all()


class ReliableProvisional(_TimerOwner):
    """RFC 3262 §3: a reliable provisional response (our 183 with RSeq) is resent by the UAS core at T1,
    2*T1, 4*T1, ... until its PRACK arrives; after 64*T1 without one it gives up (`on_give_up`: the
    UAS SHOULD then reject the INVITE with a 5xx). Over TCP nothing is resent, the deadline still holds."""

    def __init__(self, rseq: int, resend: Callable[[], None], reliable: bool, timers: Timers,
                 on_give_up: Callable[[], None]) -> None:
        super().__init__()
        self.rseq = rseq
        self._resend = resend
        if not reliable:
            self._start_timer("resend", timers.t1, lambda: self._tick(timers.t1))

        def give_up() -> None:
            self._stop_all()
            on_give_up()

        self._start_timer("give_up", 64 * timers.t1, give_up)

    def _tick(self, interval: float) -> None:
        self._resend()
        self._start_timer("resend", 2 * interval, lambda: self._tick(2 * interval))

    def stop(self) -> None:
        self._stop_all()


class InviteClientTransaction(ClientTransaction):
    """§17.1.1 (with RFC 6026's Accepted state): our re-INVITE (a session refresh), Timers A/B/D. A
    3xx-6xx is ACKed here with the INVITE's branch (§17.1.1.3); the ACK for a 2xx is the core's
    (§13.2.2.4): it hands it over with `acknowledge_2xx`, and a retransmitted 2xx is answered with it
    again while the transaction lingers (64*T1)."""

    first_state = "calling"
    _ack: bytes | None = None

    def start(self) -> None:
        self._send(self._data)
        if not self._reliable:
            self._start_timer("A", self._timers.t1, lambda: self._timer_a(self._timers.t1))
        self._start_timer("B", 64 * self._timers.t1, lambda: self._finish(None))

    def _timer_a(self, interval: float) -> None:
        self._send(self._data)
        self._start_timer("A", 2 * interval, lambda: self._timer_a(2 * interval))

    def acknowledge_2xx(self, ack: SipRequest) -> None:
        self._ack = ack.serialize()
        self._send(self._ack)

    def on_response(self, response: SipResponse) -> None:
        if response.status < 200:
            if self.state == "calling":
                self.state = "proceeding"
                self._stop_timer("A")
            return
        if self.state in ("calling", "proceeding"):
            self._stop_timer("A")
            self._stop_timer("B")
            if response.status < 300:
                self.state = "accepted"
                self._start_timer("M", 64 * self._timers.t1, self._terminate)
            else:
                self.state = "completed"
                self._send_failure_ack(response)
                self._start_timer("D", 0 if self._reliable else 32.0, self._terminate)
            if not self.result.done():
                self.result.set_result(response)
        elif self.state == "accepted" and response.status < 300 and self._ack is not None:
            self._send(self._ack)  # a retransmitted 2xx: our ACK was lost
        elif self.state == "completed" and response.status >= 300 and self._ack is not None:
            self._send(self._ack)

    def _send_failure_ack(self, response: SipResponse) -> None:
        request = self.request
        headers = [("Via", request.header_values("Via")[0]), ("Max-Forwards", "70"),
                   *(("Route", route) for route in request.header_values("Route")),
                   ("From", request.header("From") or ""), ("To", response.header("To") or ""),
                   ("Call-ID", request.call_id or ""), ("CSeq", f"{request.cseq[0]} ACK"), ("Content-Length", "0")]
        self._ack = SipRequest(method="ACK", uri=request.uri, headers=tuple(headers)).serialize()
        self._send(self._ack)

    def _finish(self, response: SipResponse | None) -> None:
        if not self.result.done():
            self.result.set_result(response)
        self._terminate()

    def _terminate(self) -> None:
        self.state = "terminated"
        self._stop_all()
        self._on_terminated(self)


def merge_key(request: SipRequest) -> tuple:
    """§8.2.2.2: requests with equal Call-ID, From tag and CSeq are one request, however they came."""
    return (request.call_id, request.from_tag, request.cseq)


class TransactionTable:
    """The live transactions, found by their keys; each removes itself when it terminates."""

    def __init__(self) -> None:
        self.server: dict[TransactionKey, ServerTransaction] = {}
        self.client: dict[TransactionKey, ClientTransaction] = {}
        self._by_request: dict[tuple, ServerTransaction] = {}  # the first transaction per merge_key
        self._branches: dict[str, int] = {}  # live server transactions per branch

    def has_branch(self, branch: str) -> bool:
        return branch in self._branches

    def add_server(self, transaction: ServerTransaction) -> None:
        self.server[transaction.key] = transaction
        self._by_request.setdefault(merge_key(transaction.request), transaction)
        branch = transaction.key[0] if str(transaction.key[0]).startswith(MAGIC_COOKIE) else ""
        self._branches[branch] = self._branches.get(branch, 0) + 1

    def forget_server(self, transaction: ServerTransaction) -> None:
        if self.server.get(transaction.key) is transaction:
            del self.server[transaction.key]
            branch = transaction.key[0] if str(transaction.key[0]).startswith(MAGIC_COOKIE) else ""
            left = self._branches.get(branch, 1) - 1
            if left > 0:
                self._branches[branch] = left
            else:
                self._branches.pop(branch, None)
        key = merge_key(transaction.request)
        if self._by_request.get(key) is transaction:
            del self._by_request[key]

    def merged_with(self, transaction: ServerTransaction) -> ServerTransaction | None:
        """An earlier live transaction for the same request on another branch (a merged request)."""
        first = self._by_request.get(merge_key(transaction.request))
        return first if first is not None and first is not transaction else None

    def add_client(self, transaction: ClientTransaction) -> None:
        self.client[transaction.key] = transaction

    def forget_client(self, transaction: ClientTransaction) -> None:
        if self.client.get(transaction.key) is transaction:
            del self.client[transaction.key]

    def match_client(self, response: SipResponse) -> ClientTransaction | None:
        """§17.1.3: top Via branch + CSeq method."""
        vias = response.vias
        if not vias:
            return None
        return self.client.get((vias[0].branch, response.cseq[1]))

    def close(self) -> None:
        for transaction in [*self.server.values(), *self.client.values()]:
            transaction._stop_all()
        self.server.clear()
        self.client.clear()
        self._by_request.clear()
        self._branches.clear()
