"""Transactions bound to the transport (RFC 3261 §17, §18): a server transaction for each request that arrives,
a client transaction for each request we send inside a dialog, and where a response goes (§18.2.2).

transaction.py owns the state machines and takes its sending as a callable; this module supplies those callables
over the `SipTransport` and keeps the `TransactionTable` current. uas.py decides what to answer and when to send;
nothing here looks at a request's method beyond INVITE or not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from gateway.sip.edge_replies import response_address
from gateway.sip.message import SipRequest, SipResponse
from gateway.sip.transaction import (
    ClientTransaction,
    InviteClientTransaction,
    InviteServerTransaction,
    NonInviteClientTransaction,
    NonInviteServerTransaction,
    ServerTransaction,
    Timers,
    TransactionTable,
)
from gateway.sip.transport import Peer, SipTransport, resolve

ClientT = TypeVar("ClientT", bound=ClientTransaction)


class TransactionSender:
    def __init__(self, transport: SipTransport, transactions: TransactionTable, timers: Timers) -> None:
        self._transport = transport
        self._transactions = transactions
        self._timers = timers

    def new_server(self, request: SipRequest, peer: Peer) -> ServerTransaction:
        kind = InviteServerTransaction if request.method == "INVITE" else NonInviteServerTransaction
        transaction = kind(request, lambda response: self.response_sender(response, peer)(),
                           peer.transport == "tcp", self._timers, self._transactions.forget_server)
        self._transactions.add_server(transaction)
        return transaction

    def response_sender(self, response: SipResponse, peer: Peer) -> Callable[[], None]:
        """§18.2.2: reliable -> the request's connection; UDP -> the address edge_replies names."""
        data = response.serialize()
        address = response_address(response, reliable=peer.transport == "tcp")
        if peer.transport == "tcp":
            return lambda: self._transport.send(data, "tcp", address, peer.connection)
        return lambda: self._transport.send(data, "udp", address)

    async def send_request(self, request: SipRequest, transport: str, host: str, port: int,
                           peer: Peer) -> SipResponse | None:
        """A request inside a dialog (our BYE or UPDATE) -> its final response, None on timeout."""
        transaction = await self._start_client(NonInviteClientTransaction, request, transport, host, port, peer)
        return await transaction.result

    async def send_invite(self, request: SipRequest, transport: str, host: str, port: int,
                          peer: Peer) -> InviteClientTransaction:
        """Start our re-INVITE inside a dialog (§17.1.1); the caller awaits its `result` and ACKs a 2xx."""
        return await self._start_client(InviteClientTransaction, request, transport, host, port, peer)

    async def _start_client(self, kind: type[ClientT], request: SipRequest, transport: str, host: str, port: int,
                            peer: Peer) -> ClientT:
        address = await resolve(host, port)
        # Keep the dialog on the connection it arrived on while it is open (clients behind NAT and
        # SIPp's single-socket TCP mode only listen there); else §18.1.1 opens a new one.
        connection = peer.connection if transport == "tcp" else None

        def send(data: bytes) -> None:
            self._transport.send(data, transport, address, connection)

        transaction = kind(request, send, transport == "tcp", self._timers, self._transactions.forget_client)
        self._transactions.add_client(transaction)
        transaction.start()
        return transaction
