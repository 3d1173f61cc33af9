"""Whose RTP a call accepts: the SDP's address, or with latching the first packet from an allowed host."""

from __future__ import annotations

from gateway.media.rtp_peer import RtpPeer


def _peer(latching: str, signalling_host: str | None = "198.51.100.7") -> RtpPeer:
    peer = RtpPeer(latching, signalling_host)
    peer.expect("192.0.2.10", 4000, 4001)
    return peer


def test_without_latching_only_the_sdp_address_is_the_partner() -> None:
    peer = _peer("off")
    assert not peer.admit(("192.0.2.10", 4002))  # same host, other port
    assert not peer.admit(("198.51.100.7", 4000))  # the signalling source
    assert peer.admit(("192.0.2.10", 4000))
    assert peer.remote == ("192.0.2.10", 4000) and peer.remote_rtcp == ("192.0.2.10", 4001)


def test_sdp_host_latches_a_natd_port_once_and_refuses_other_hosts() -> None:
    peer = _peer("sdp_host")
    assert not peer.admit(("203.0.113.5", 4000))  # another host never latches
    assert not peer.admit(("198.51.100.7", 4000))  # nor, in this mode, the signalling source
    assert peer.remote == ("192.0.2.10", 4000) and not peer.latched
    assert peer.admit(("192.0.2.10", 34000))
    assert peer.remote == ("192.0.2.10", 34000) and peer.remote_rtcp == ("192.0.2.10", 34001)
    assert not peer.admit(("192.0.2.10", 4000))  # fixed after the first valid packet, even the SDP port
    assert not peer.admit(("192.0.2.10", 34002))
    assert peer.admit(("192.0.2.10", 34000))


def test_a_packet_from_the_sdp_address_ends_latching() -> None:
    peer = _peer("sdp_host")
    assert peer.admit(("192.0.2.10", 4000)) and peer.latched
    assert not peer.admit(("192.0.2.10", 34000))


def test_signalling_source_may_latch_when_the_sdp_names_a_private_address() -> None:
    peer = RtpPeer("signalling_source", "198.51.100.7")
    peer.expect("10.0.0.5", 4000, 4001)
    assert not peer.admit(("203.0.113.5", 4000))
    assert peer.admit(("198.51.100.7", 61000)) and peer.remote == ("198.51.100.7", 61000)
    assert not peer.admit(("10.0.0.5", 4000))


def test_a_new_sdp_address_starts_over() -> None:
    peer = _peer("sdp_host")
    assert peer.admit(("192.0.2.10", 34000))
    peer.expect("192.0.2.11", 5000, 5001)  # re-INVITE moved the media
    assert not peer.admit(("192.0.2.10", 34000))
    assert peer.admit(("192.0.2.11", 35000)) and peer.remote == ("192.0.2.11", 35000)


def test_rtcp_is_accepted_from_the_partners_host_only() -> None:
    peer = _peer("off")
    assert peer.admit_rtcp(("192.0.2.10", 4001)) and peer.admit_rtcp(("192.0.2.10", 9999))
    assert not peer.admit_rtcp(("203.0.113.5", 4001))


def test_sdp_hosts_compare_in_the_form_sockets_report() -> None:
    peer = RtpPeer("off")
    peer.expect("2001:db8:0:0::1", 4000, 4001)
    assert peer.admit(("2001:db8::1", 4000))
