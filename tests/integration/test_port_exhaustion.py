"""RTP ports as an attacker and a busy day spend them, against a real `serve` process over raw SIP:

- offers whose RTCP port is no port (a=rtcp:70000, m=audio 65535 whose RTCP would be 65536) get 488 with a
  Warning naming it; 60 of them leave the process's open descriptors and the port pool as they were (each
  used to leak a socket and a port pair for good, and five exhausted a small range: every INVITE then 480);
- with every port pair held by a live call, INVITE and OPTIONS get 503 + Retry-After and /healthz 503
  no_rtp_ports; once the calls end, a normal call is answered and nothing is left behind;
- ports another program holds: 503 (they used to get 480).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import urllib.request

import pytest

from gateway import metrics
from integration_harness import invite_final_response, start_gateway
from serve_process import ServeProcess, start_serve
from tests.gateway.sip.peers import UdpPeer, raw_request, udp_peer

pytestmark = [pytest.mark.timeout(120)]

PAIRS = 4
PORT_BASE = 44000 + (os.getpid() % 400) * 10  # a range of our own: parallel runs on the box do not collide


def _sdp(rtp_port: int, *extra: str) -> str:
    lines = ["v=0", "o=caller 1 1 IN IP4 127.0.0.1", "s=-", "c=IN IP4 127.0.0.1", "t=0 0",
             f"m=audio {rtp_port} RTP/AVP 0", "a=rtpmap:0 PCMU/8000", *extra]
    return "".join(line + "\r\n" for line in lines)


class Caller:
    """One raw UDP SIP caller; requests are told apart by Call-ID."""

    def __init__(self, peer: UdpPeer, gateway: ServeProcess) -> None:
        self.peer, self.address, self.serial = peer, gateway.sip_address, 0

    def send(self, method: str, call_id: str, **kwargs) -> None:
        self.peer.send(raw_request(method, self.peer.port, call_id=call_id, **kwargs), self.address)

    async def final(self, call_id: str):
        while True:
            response = await self.peer.response(timeout=10)
            if response.call_id == call_id and response.status >= 200:
                return response

    async def invite(self, sdp: str):
        """INVITE (a prompt, then stay); returns the final response, ACKed whatever it is."""
        self.serial += 1
        call_id, branch = f"call-{self.serial}", f"z9hG4bK-inv-{self.serial}"
        self.send("INVITE", call_id, branch=branch, body=sdp, extra="X-TTS-Text: hi\r\nX-TTS-After: stay\r\n")
        response = await self.final(call_id)
        ack_branch = branch if response.status >= 300 else f"z9hG4bK-ack-{self.serial}"  # §17.1.1.3 / §13.2.2.4
        self.send("ACK", call_id, branch=ack_branch, to_tag=response.to_tag)
        return response

    async def bye(self, ok) -> int:
        self.send("BYE", ok.call_id, branch=f"z9hG4bK-bye-{ok.call_id}", cseq=2, to_tag=ok.to_tag)
        return (await self.final(ok.call_id)).status

    async def options(self) -> tuple[int, str | None]:
        self.serial += 1
        call_id = f"options-{self.serial}"
        self.send("OPTIONS", call_id, branch=f"z9hG4bK-opt-{self.serial}")
        response = await self.final(call_id)
        return response.status, response.header("Retry-After")


async def _fds(gateway: ServeProcess) -> int:
    """The process's open descriptors, once the /healthz connection just made has been closed on its side:
    the same count over 0.2 s."""
    counts: list[int] = []
    while len(counts) < 5 or len(set(counts[-5:])) > 1:
        counts.append(len(os.listdir(f"/proc/{gateway.process.pid}/fd")))
        await asyncio.sleep(0.05)
    return counts[-1]


def _metric(gateway: ServeProcess, line_start: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/metrics", timeout=2) as response:
        text = response.read().decode()
    return next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(line_start)), 0.0)


async def _idle(gateway: ServeProcess) -> dict:
    """/healthz once every call has ended and its ports are back."""
    for _ in range(100):
        status, body = await gateway.healthz()
        if body["calls_active"] == 0 and body["rtp_port_pairs_free"] == body["rtp_port_pairs_total"]:
            return body
        await asyncio.sleep(0.05)
    raise AssertionError(f"calls or ports still held: {json.dumps(body)}")


async def test_bad_rtcp_ports_leak_nothing_and_exhaustion_answers_503(tmp_path):
    gateway = await start_serve(tmp_path, None, f"media.rtp_port_range={PORT_BASE}-{PORT_BASE + 2 * PAIRS - 1}",
                                "shutdown.drain_timeout_s=0.5", engine="instant")
    peer, media = await udp_peer(), await udp_peer()  # SIP, and a sink for the prompts' RTP
    caller = Caller(peer, gateway)
    try:
        await gateway.wait_healthy()
        ok = await caller.invite(_sdp(media.port))  # a first call, so every lazily made object exists
        assert ok.status == 200 and await caller.bye(ok) == 200
        health = await _idle(gateway)
        assert health["rtp_port_pairs_total"] == PAIRS
        fds_before = await _fds(gateway)

        for i in range(60):
            bad = _sdp(media.port, "a=rtcp:70000") if i % 2 else _sdp(65535)
            refused = await caller.invite(bad)
            assert refused.status == 488, refused
            assert ("a=rtcp:70000" if i % 2 else "m=audio port 65535") in refused.header("Warning")
        assert await _fds(gateway) == fds_before
        assert (await _idle(gateway))["rtp_port_pairs_free"] == PAIRS

        held = [await caller.invite(_sdp(media.port)) for _ in range(PAIRS)]  # every pair held by a live call
        assert [call.status for call in held] == [200] * PAIRS
        refused_before = _metric(gateway, 'gateway_calls_refused_total{reason="no_rtp_ports"}')
        refused = await caller.invite(_sdp(media.port))
        assert (refused.status, refused.header("Retry-After")) == (503, "5")
        assert await caller.options() == (503, "5")  # a proxy's qualify ping routes elsewhere too
        status, body = await gateway.healthz()
        assert (status, body["status"], body["rtp_port_pairs_free"]) == (503, "no_rtp_ports", 0)
        assert _metric(gateway, 'gateway_calls_refused_total{reason="no_rtp_ports"}') == refused_before + 1

        assert [await caller.bye(call) for call in held] == [200] * PAIRS
        await _idle(gateway)
        assert await caller.options() == (200, None)
        ok = await caller.invite(_sdp(media.port))  # a normal call is answered again
        assert ok.status == 200 and await caller.bye(ok) == 200
        assert (await _idle(gateway))["status"] == "ok"
        assert await _fds(gateway) == fds_before
        assert await gateway.stop() == 0
    finally:
        peer.transport.close()
        media.transport.close()
        await gateway.stop()


async def test_ports_taken_by_another_process_answer_503_not_480(tmp_path):
    """The pool thinks the pairs are free but every bind fails (another program holds them): the call is
    refused 503 + Retry-After (reason no_rtp_ports); once the ports are free again a call is answered."""
    base = PORT_BASE + 2 * PAIRS + 2  # beside the range of the test above
    gateway = await start_gateway("instant", extra={"media.rtp_port_range": f"{base}-{base + 3}",
                                                    "sip.retry_after_s": 9})
    squatters = []
    try:
        for port in range(base, base + 4):
            squatter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            squatters.append(squatter)
            squatter.bind(("127.0.0.1", port))
        refused_before = metrics.registry.get_sample_value("gateway_calls_refused_total",
                                                           {"reason": "no_rtp_ports"}) or 0.0
        assert await invite_final_response(gateway.sip.udp_address, {"X-TTS-Text": "hi"}) == \
            "SIP/2.0 503 Service Unavailable"
        assert metrics.registry.get_sample_value("gateway_calls_refused_total",
                                                 {"reason": "no_rtp_ports"}) == refused_before + 1
        for squatter in squatters:
            squatter.close()
        assert (await invite_final_response(gateway.sip.udp_address, {"X-TTS-Text": "hi"})).startswith("SIP/2.0 200")
    finally:
        for squatter in squatters:
            squatter.close()
        await gateway.stop()
