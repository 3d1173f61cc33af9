"""RFC 4733 key presses from the caller reach the call as events: with barge-in, a key stops the prompt."""

from __future__ import annotations

import asyncio
import re
import socket

import pytest

from gateway import metrics
from gateway.media.dtmf import TelephoneEvent
from gateway.media.rtp import pack_header
from integration_harness import rtp_recorder, start_gateway

pytestmark = pytest.mark.timeout(60)

LONG = "This maintenance message is long, so that the caller has every reason to press a key and skip it. " * 3


async def _request(sock: socket.socket, data: bytes, to: tuple[str, int]) -> None:
    await asyncio.get_running_loop().sock_sendto(sock, data, to)


async def _next_message(sock: socket.socket, timeout: float = 10.0) -> str:
    data = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 65535), timeout)
    return data.decode()


async def test_key_press_barges_in_and_the_gateway_hangs_up():
    gateway = await start_gateway("espeak", extra={"routes": [
        {"match": "4930", "text": LONG, "voice": "en", "barge_in": True, "after": "hangup"}]})
    sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sip.bind(("127.0.0.1", 0))
    sip.setblocking(False)
    port = sip.getsockname()[1]
    rtp = await rtp_recorder()
    dtmf0 = metrics.registry.get_sample_value("gateway_dtmf_events_total") or 0.0
    try:
        host, sip_port = gateway.sip.udp_address
        sdp = ("v=0\r\no=t 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
               f"m=audio {rtp.port} RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\n"
               "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-16\r\n")
        common = (f"From: <sip:caller@127.0.0.1>;tag=dtmf{port}\r\nCall-ID: dtmf-{port}\r\n"
                  f"Contact: <sip:caller@127.0.0.1:{port}>\r\nMax-Forwards: 70\r\n")
        invite = (f"INVITE sip:4930@{host}:{sip_port} SIP/2.0\r\n"
                  f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-dtmf-1;rport\r\n{common}"
                  f"To: <sip:4930@{host}>\r\nCSeq: 1 INVITE\r\nContent-Type: application/sdp\r\n"
                  f"Content-Length: {len(sdp)}\r\n\r\n{sdp}")
        await _request(sip, invite.encode(), (host, sip_port))
        while not (ok := await _next_message(sip)).startswith("SIP/2.0 200"):
            pass
        to_header = re.search(r"^To: (.*)$", ok, re.M | re.I).group(1).strip()
        media_port = int(re.search(r"^m=audio (\d+)", ok, re.M).group(1))
        ack = (f"ACK sip:4930@{host}:{sip_port} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-dtmf-2;rport\r\n{common}"
               f"To: {to_header}\r\nCSeq: 1 ACK\r\nContent-Length: 0\r\n\r\n")
        await _request(sip, ack.encode(), (host, sip_port))
        await asyncio.sleep(1.0)  # let the prompt play for a second
        spoken_before_key = len(rtp.packets)
        # key '5' from the caller's own RTP socket (symmetric RTP: the gateway latches to it): a start packet,
        # one update, three end packets (RFC 4733 §2.5.1.4), all with the event's one timestamp
        for seq, (duration, end) in enumerate([(160, False), (320, False), (480, True), (480, True), (480, True)]):
            payload = TelephoneEvent(event=5, end=end, volume=10, duration=duration).serialize()
            rtp.transport.sendto(pack_header(101, 1000 + seq, 8000, 0x5EED, marker=seq == 0) + payload,
                                 ("127.0.0.1", media_port))
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
