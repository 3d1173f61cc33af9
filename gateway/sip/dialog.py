"""The UAS side of one dialog (RFC 3261 §12): its identity, route set, targets and sequence numbers,
and how to build the requests we send inside it (our BYE, session refreshes and their ACKs). Pure: no sockets, no clocks.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from gateway.sip.header_values import NameAddr, SipUri
from gateway.sip.message import SipRequest

DialogKey = tuple[str, str, str | None]  # (Call-ID, local tag, remote tag)


def new_tag() -> str:
    return secrets.token_hex(6)


def new_branch() -> str:
    return "z9hG4bK" + secrets.token_hex(10)


@dataclass(frozen=True)
class NextHop:
    """Where a request inside the dialog goes first (§8.1.2 with a simplified RFC 3263)."""

    host: str
    port: int
    transport: str  # "udp" | "tcp"


class Dialog:
    """Dialog state built from the INVITE as a UAS (§12.1.1); updated by target refreshes."""

    def __init__(self, invite: SipRequest, local_tag: str) -> None:
        self.call_id = invite.call_id or ""
        self.local_tag = local_tag
        self.remote_tag = invite.from_tag
        self.local_uri = f"{invite.header('To')};tag={local_tag}"  # our From in requests we send
        self.remote_uri = invite.header("From") or ""
        # §12.1.1: the route set is the Record-Route list in order; the remote target is the Contact.
        self.route_set = tuple(invite.header_values("Record-Route"))
        self.remote_target = _contact_uri(invite) or invite.uri
        self.remote_cseq = invite.cseq[0]
        self.local_cseq = secrets.randbelow(2**16) + 1  # §12.2.1.1: any start value below 2**31

    @property
    def key(self) -> DialogKey:
        return (self.call_id, self.local_tag, self.remote_tag)

    def refresh_target(self, request: SipRequest) -> None:
        """§12.2.2: a re-INVITE or UPDATE with a Contact replaces the remote target."""
        target = _contact_uri(request)
        if target:
            self.remote_target = target

    def accept_sequence(self, request: SipRequest) -> bool:
        """§12.2.2: a request with a CSeq lower than the last one seen is out of order (500)."""
        number = request.cseq[0]
        if number < self.remote_cseq:
            return False
        self.remote_cseq = number
        return True

    def make_request(self, method: str, via_sent_by: str, transport: str, user_agent: str,
                     headers: tuple[tuple[str, str], ...] = (), cseq: int | None = None
                     ) -> tuple[SipRequest, NextHop]:
        """A request inside the dialog (§12.2.1.1), and the next hop to send it to. `cseq` reuses a number
        (the ACK of a 2xx carries its INVITE's, §13.2.2.4); otherwise the next local CSeq is taken."""
        if cseq is None:
            self.local_cseq += 1
            cseq = self.local_cseq
        routes = list(self.route_set)
        uri = self.remote_target
        if routes and not _is_loose(routes[0]):
            # Strict routing (RFC 2543 proxy): first route becomes the Request-URI, the remote
            # target goes to the end of the Route list.
            uri = NameAddr.parse(routes[0]).uri.split(";", 1)[0]
            routes = routes[1:] + [f"<{self.remote_target}>"]
        lines = [
            ("Via", f"SIP/2.0/{transport.upper()} {via_sent_by};branch={new_branch()};rport"),
            ("Max-Forwards", "70"),
            *(("Route", route) for route in routes),
            ("From", self.local_uri),
            ("To", self.remote_uri),
            ("Call-ID", self.call_id),
            ("CSeq", f"{cseq} {method}"),
            ("User-Agent", user_agent),
            *headers,
        ]
        request = SipRequest(method=method, uri=uri, headers=tuple(lines))
        first_hop = NameAddr.parse(self.route_set[0]).uri if self.route_set else self.remote_target
        return request, next_hop(first_hop, transport)


def next_hop(uri: str, default_transport: str) -> NextHop:
    parsed = SipUri.parse(uri)
    transport = (parsed.param("transport") or default_transport).lower()
    host = parsed.param("maddr") or parsed.host
    port = parsed.port or (5061 if parsed.scheme == "sips" else 5060)
    return NextHop(host, port, transport if transport in ("udp", "tcp") else default_transport)


def _contact_uri(request: SipRequest) -> str | None:
    contacts = request.header_values("Contact")
    if not contacts or contacts[0] == "*":
        return None
    return NameAddr.parse(contacts[0]).uri


def _is_loose(route: str) -> bool:
    return SipUri.parse(NameAddr.parse(route).uri).has_param("lr")

