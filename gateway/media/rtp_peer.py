"""Who a call's media partner is: where our RTP goes and which source addresses may send us RTP.

Without latching the partner is exactly the address the SDP names: we send there, and only packets
from there (symmetric RTP, RFC 4961) are accepted. A phone behind NAT names an address we cannot
reach, so an operator may enable latching: the first valid packet from an allowed host fixes the
partner's address (host and port) for the rest of the negotiation, and from then on only that address
is accepted. Allowed hosts are the SDP's host (`sdp_host`: NAT rewrote the port only) or that plus the
host the INVITE came from (`signalling_source`: the SDP names a private address, RTP comes from the
phone's public one). Latching to whoever sends first, from anywhere, would hand the call's audio and
key presses to any third party that guesses the port (the hijack RFC 7362's security considerations
warn of).

A new SDP address (re-INVITE) starts over: the signalling is authenticated, the media source is not.
Pure decisions, no sockets: the RTP session asks `admit()` for every received packet.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

Latching = Literal["off", "sdp_host", "signalling_source"]  # config.MediaSection.rtp_latching names the same


def normalized_host(host: str) -> str:
    """The host as the socket layer reports a source address ('::0:1' -> '::1'); names pass unchanged."""
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host


class RtpPeer:
    def __init__(self, latching: Latching = "off", signalling_host: str | None = None) -> None:
        self.latching = latching
        self.remote: tuple[str, int] = ("0.0.0.0", 0)
        self.remote_rtcp: tuple[str, int] = ("0.0.0.0", 0)
        self._signalling_host = normalized_host(signalling_host) if signalling_host else None
        self._latch_hosts: frozenset[str] = frozenset()
        self._latched = True  # nothing to latch until the SDP names an address

    def expect(self, host: str, port: int, rtcp_port: int) -> None:
        """The address the (re)negotiated SDP names; an IP literal. Restarts latching if it is enabled."""
        host = normalized_host(host)
        self.remote, self.remote_rtcp = (host, port), (host, rtcp_port)
        hosts = {host} if self.latching != "off" else set()
        if self.latching == "signalling_source" and self._signalling_host is not None:
            hosts.add(self._signalling_host)
        self._latch_hosts = frozenset(hosts)
        self._latched = not hosts

    def admit(self, source: tuple[str, int]) -> bool:
        """Whether a valid RTP packet from `source` (host, port) is the partner's; may latch to it.

        On the receive hot path: the common case is one tuple comparison.
        """
        if source == self.remote:
            self._latched = True
            return True
        if self._latched or source[0] not in self._latch_hosts:
            return False
        self._latched = True
        self.remote = source
        # RTCP is expected on the next port of the NAT binding; NATs that keep port parity do that.
        self.remote_rtcp = (source[0], source[1] + 1)
        return True

    def admit_rtcp(self, source: tuple[str, int]) -> bool:
        """RTCP is accepted from the partner's host only (its port may be NAT'd independently of RTP's)."""
        return source[0] == self.remote[0] or source[0] == self.remote_rtcp[0]

    @property
    def latched(self) -> bool:
        """True once the partner's address is fixed (always, without latching)."""
        return self._latched
