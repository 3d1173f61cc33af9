"""A cloud host's public (1:1 NAT) address, over loopback (issue #33 item 1): `serve` binds SIP and RTP to
127.0.0.1 and advertises 192.0.2.10 (TEST-NET-1, on no interface here). A raw-socket caller on 127.0.0.1
gets a 200 whose Contact and SDP (c=, o=) carry the advertised address, hears the prompt from the local
RTP port the SDP names, and is sent a BYE whose Via carries the advertised address too. An address RTP
cannot bind stops the start with one line naming the key."""

from __future__ import annotations

import asyncio
import re
import socket

import numpy as np
import pytest

from integration_harness import rtp_recorder
from serve_process import start_serve

pytestmark = [pytest.mark.timeout(90)]

PUBLIC = "192.0.2.10"


def _invite(sip_port: int, port: int, rtp_port: int) -> bytes:
    sdp = (f"v=0\r\no=caller 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n")
    return (f"INVITE sip:1000@127.0.0.1:{sip_port} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-nat-{port};rport\r\n"
            f"From: <sip:caller@127.0.0.1>;tag=nat{port}\r\nTo: <sip:1000@127.0.0.1>\r\n"
            f"Call-ID: nat-{port}@127.0.0.1\r\nCSeq: 1 INVITE\r\nContact: <sip:caller@127.0.0.1:{port}>\r\n"
            f"Max-Forwards: 70\r\nX-TTS-Text: Hello from behind the NAT.\r\n"
            f"Content-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}").encode()


def _header(message: str, name: str) -> str:
    match = re.search(rf"^{name}:\s*(.*)$", message, re.MULTILINE | re.IGNORECASE)
    assert match, f"no {name} in:\n{message}"
    return match.group(1).strip()


def _reply_200(request: str) -> bytes:
    """200 OK to a request the gateway sent (its BYE), echoing the headers §8.2.6.2 asks for."""
    heads = "".join(f"{name}: {_header(request, name)}\r\n" for name in ("Via", "From", "To", "Call-ID", "CSeq"))
    return f"SIP/2.0 200 OK\r\n{heads}Content-Length: 0\r\n\r\n".encode()


async def test_an_advertised_public_address_is_in_contact_and_sdp_and_the_call_is_heard(tmp_path):
    gateway = await start_serve(tmp_path, None, f"sip.advertised_host={PUBLIC}", "media.rtp_port_range=45000-45099",
                                engine="espeak")
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    recorder = await rtp_recorder()
    try:
        await gateway.wait_healthy()
        await loop.sock_sendto(sock, _invite(gateway.sip_port, port, recorder.port), gateway.sip_address)
        while not (answer := (await asyncio.wait_for(loop.sock_recv(sock, 65535), 20)).decode()).startswith(
                "SIP/2.0 2"):
            assert answer.startswith("SIP/2.0 1"), answer.split("\r\n", 1)[0]
        assert re.fullmatch(rf"<sip:{re.escape(PUBLIC)}:{gateway.sip_port}(;[^>]*)?>(;.*)?", _header(answer, "Contact"))
        body = answer.split("\r\n\r\n", 1)[1]
        assert f"c=IN IP4 {PUBLIC}\r\n" in body and re.search(rf"^o=\S+ \d+ \d+ IN IP4 {PUBLIC}\r$", body, re.M)
        rtp_port = int(re.search(r"^m=audio (\d+) ", body, re.M).group(1))
        to = _header(answer, "To")
        ack = (f"ACK sip:{PUBLIC}:{gateway.sip_port} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-nat-ack-{port};rport\r\n"
               f"From: <sip:caller@127.0.0.1>;tag=nat{port}\r\nTo: {to}\r\nCall-ID: nat-{port}@127.0.0.1\r\n"
               f"CSeq: 1 ACK\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n").encode()
        await loop.sock_sendto(sock, ack, gateway.sip_address)

        # the prompt plays, then the gateway hangs up: its BYE comes to our Contact with its Via advertised
        bye = (await asyncio.wait_for(loop.sock_recv(sock, 65535), 30)).decode()
        while not bye.startswith("BYE "):
            bye = (await asyncio.wait_for(loop.sock_recv(sock, 65535), 30)).decode()
        assert _header(bye, "Via").startswith(f"SIP/2.0/UDP {PUBLIC}:{gateway.sip_port}")
        await loop.sock_sendto(sock, _reply_200(bye), gateway.sip_address)
        # RTP came from the local address (bound 127.0.0.1, the port the SDP named), and it was speech
        assert recorder.sources == [("127.0.0.1", rtp_port)]
        audio = recorder.audio("PCMU")
        assert len(audio) > 8000 * 0.5  # over half a second of it
        assert float(np.sqrt(np.mean(np.square(audio.astype(np.float64))))) > 300  # int16 RMS: heard, not silence
        assert not [e for e in gateway.log_events() if e.get("level") == "error"]
    finally:
        sock.close()
        recorder.transport.close()
        assert await gateway.stop() == 0


async def test_rtp_bound_to_an_address_not_on_this_host_is_one_line_at_start(tmp_path):
    gateway = await start_serve(tmp_path, None, f"media.bind_address={PUBLIC}", engine="instant")
    assert await gateway.process.wait() == 2
    log = gateway.tail(20000)
    assert "Traceback" not in log
    assert log.strip().splitlines()[-1] == (
        f"cosyvoice-gateway: config error: media.bind_address: cannot bind RTP on {PUBLIC} (Cannot assign requested "
        "address); bind an address of this host and put a public or NAT address in sip.advertised_host / "
        "media.advertised_address")


async def test_sip_listening_on_an_address_not_on_this_host_names_sip_listen(tmp_path):
    """The public address put in sip.listen instead of sip.advertised_host: the key the operator wrote is named."""
    gateway = await start_serve(tmp_path, None, f"sip.listen={PUBLIC}:5060", engine="instant")
    assert await gateway.process.wait() == 2
    last = gateway.tail(20000).strip().splitlines()[-1]
    assert last.startswith(f"cosyvoice-gateway: config error: sip.listen: cannot bind RTP on {PUBLIC} "), last
