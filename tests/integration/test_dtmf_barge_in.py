"""RFC 4733 key presses from the caller reach the call as events: with barge-in, a key stops the prompt.

Only the caller's own RTP address counts: a third party that sends RTP and key presses to the call's
port, never having seen the signalling, gets none of the prompt and cannot stop it.
"""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from gateway import metrics
from gateway.media.dtmf import TelephoneEvent
from gateway.media.rtp import pack_header
from integration_harness import RtpRecorder, rtp_recorder, start_gateway

pytestmark = pytest.mark.timeout(60)

LONG = "This maintenance message is long, so that the caller has every reason to press a key and skip it. " * 3


async def _request(sock: socket.socket, data: bytes, to: tuple[str, int]) -> None:
    await asyncio.get_running_loop().sock_sendto(sock, data, to)


async def _next_message(sock: socket.socket, timeout: float = 10.0) -> str:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65535), timeout)
    return data.decode()


async def _answered_barge_in_call(gateway, sip: socket.socket, rtp: RtpRecorder) -> int:
    """INVITE 4930 from `sip` offering `rtp`'s port on 127.0.0.1, ACK the 200; returns the gateway's RTP port."""
    me, port = sip.getsockname()
    host, sip_port = gateway.sip.udp_address
    sdp = ("v=0\r\no=t 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp.port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
           "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n")
    common = (f"From: <sip:caller@{me}>;tag=dtmf{port}\r\nCall-ID: dtmf-{port}\r\n"
              f"Contact: <sip:caller@{me}:{port}>\r\nMax-Forwards: 70\r\n")
    invite = (f"INVITE sip:4930@{host}:{sip_port} SIP/2.0\r\n"
              f"Via: SIP/2.0/UDP {me}:{port};branch=z9hG4bK-dtmf-1;rport\r\n{common}"
              f"To: <sip:4930@{host}>\r\nCSeq: 1 INVITE\r\nContent-Type: application/sdp\r\n"
              f"Content-Length: {len(sdp)}\r\n\r\n{sdp}")
    await _request(sip, invite.encode(), (host, sip_port))
    while not (ok := await _next_message(sip)).startswith("SIP/2.0 200"):
        pass
    to_header = re.search(r"^To: (.*)$", ok, re.M | re.I).group(1).strip()
    ack = (f"ACK sip:4930@{host}:{sip_port} SIP/2.0\r\n"
           f"Via: SIP/2.0/UDP {me}:{port};branch=z9hG4bK-dtmf-2;rport\r\n{common}"
           f"To: {to_header}\r\nCSeq: 1 ACK\r\nContent-Length: 0\r\n\r\n")
    await _request(sip, ack.encode(), (host, sip_port))
    return int(re.search(r"^m=audio (\d+)", ok, re.M).group(1))


def _press_5(sender: RtpRecorder, media_port: int, ssrc: int = 0x5EED) -> None:
    """Key '5': a start packet, one update, three end packets (RFC 4733 §2.5.1.4), one timestamp."""
    for seq, (duration, end) in enumerate([(160, False), (320, False), (480, True), (480, True), (480, True)]):
        payload = TelephoneEvent(event=5, end=end, volume=10, duration=duration).serialize()
        sender.transport.sendto(pack_header(101, 1000 + seq, 8000, ssrc, marker=seq == 0) + payload,
                                ("127.0.0.1", media_port))


def _dropped_foreign() -> float:
    return metrics.registry.get_sample_value("gateway_rtp_packets_dropped_total", {"reason": "foreign_source"}) or 0.0


async def test_key_press_barges_in_and_the_gateway_hangs_up():
    gateway = await start_gateway("espeak", extra={"routes": [
        {"match": "4930", "text": LONG, "voice": "en", "barge_in": True, "after": "hangup"}]})
    sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sip.bind(("127.0.0.1", 0))
    sip.setblocking(False)
    rtp = await rtp_recorder()
    dtmf0 = metrics.registry.get_sample_value("gateway_dtmf_events_total") or 0.0
    try:
        media_port = await _answered_barge_in_call(gateway, sip, rtp)
        await rtp.wait_for_packets(50)  # let the prompt play for a second (50 packets of 20 ms)
        spoken_before_key = len(rtp.packets)
        _press_5(rtp, media_port)  # from the caller's own RTP socket, the address its SDP names
        bye = await _next_message(sip)
        assert bye.startswith("BYE "), bye
        heard = len(rtp.packets)
        assert spoken_before_key > 30
        assert heard < spoken_before_key + 25  # stopped within half a second of the key, long before the end
        assert (metrics.registry.get_sample_value("gateway_dtmf_events_total") or 0) == dtmf0 + 1
    finally:
        sip.close()
        rtp.transport.close()
        await gateway.stop()


async def test_a_third_party_neither_hears_the_prompt_nor_stops_it_with_a_key():
    gateway = await start_gateway("espeak", extra={"routes": [
        {"match": "4930", "text": LONG, "voice": "en", "barge_in": True, "after": "hangup"}]})
    sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sip.bind(("127.0.0.1", 0))
    sip.setblocking(False)
    caller = await rtp_recorder()
    loop = asyncio.get_running_loop()
    intruders = []
    for host in ("127.0.0.1", "127.0.0.2"):  # the caller's host from another port, and another host
        transport, intruder = await loop.create_datagram_endpoint(RtpRecorder, local_addr=(host, 0))
        intruder.transport = transport
        intruders.append(intruder)
    dtmf0, dropped0 = metrics.registry.get_sample_value("gateway_dtmf_events_total") or 0.0, _dropped_foreign()
    try:
        media_port = await _answered_barge_in_call(gateway, sip, caller)
        for intruder in intruders:  # before the caller sends anything: the moment an old-style latch is won
            intruder.transport.sendto(pack_header(0, 1, 160, 0xBAD, False) + bytes(160), ("127.0.0.1", media_port))
            _press_5(intruder, media_port, ssrc=0xBAD)
        # The caller hears another second of prompt (a barge-in would have stopped it: this times out).
        await caller.wait_for_packets(len(caller.packets) + 50)
        assert not intruders[0].packets and not intruders[1].packets
        assert _dropped_foreign() == dropped0 + 12
        assert (metrics.registry.get_sample_value("gateway_dtmf_events_total") or 0) == dtmf0
        with pytest.raises(TimeoutError):  # no BYE: the prompt goes on
            await _next_message(sip, timeout=0.01)
        _press_5(caller, media_port)  # the caller's own key still works
        assert (await _next_message(sip)).startswith("BYE ")
        assert not intruders[0].packets and not intruders[1].packets
    finally:
        sip.close()
        caller.transport.close()
        for intruder in intruders:
            intruder.transport.close()
        await gateway.stop()


async def test_with_signalling_source_latching_a_natd_phone_is_heard_from_the_invites_host():
    gateway = await start_gateway("espeak", extra={"media.rtp_latching": "signalling_source", "routes": [
        {"match": "4930", "text": LONG, "voice": "en", "barge_in": True, "after": "hangup"}]})
    sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sip.bind(("127.0.0.3", 0))  # the phone's public address; its SDP names 127.0.0.1 (the "private" one)
    sip.setblocking(False)
    loop = asyncio.get_running_loop()
    phones = []
    for host in ("127.0.0.1", "127.0.0.3", "127.0.0.2"):  # SDP address, NAT'd source, a stranger
        transport, phone = await loop.create_datagram_endpoint(RtpRecorder, local_addr=(host, 0))
        phone.transport = transport
        phones.append(phone)
    private, public, stranger = phones
    try:
        media_port = await _answered_barge_in_call(gateway, sip, private)
        _press_5(stranger, media_port, ssrc=0xBAD)  # first, but from a host neither the SDP nor the INVITE named
        public.transport.sendto(pack_header(0, 1, 160, 0xCAFE, False) + bytes(160), ("127.0.0.1", media_port))
        await public.wait_for_packets(31)  # latched: the prompt goes to the NAT'd address
        _press_5(public, media_port, ssrc=0xCAFE)
        assert (await _next_message(sip)).startswith("BYE ")
        assert not stranger.packets
    finally:
        sip.close()
        for phone in phones:
            phone.transport.close()
        await gateway.stop()
