"""Flood shedding over real sockets: one source over its budget gets a few cheap 503s and silence,
counted in metrics and logged once; another source and the flooder's own transactions are unharmed."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from gateway import metrics
from gateway.sip.message import SipResponse, parse
from gateway.sip.rate_limit import FloodLimits
from tests.gateway.sip.peers import ANSWER_SDP, raw_request, udp_peer

pytestmark = pytest.mark.timeout(20)


def _shed(action: str) -> float:
    return metrics.registry.get_sample_value("gateway_sip_rate_limited_total", {"action": action}) or 0.0


async def test_flood_is_shed_with_503_counted_and_logged_once(make_server):
    server, phone = await make_server("ring", flood=FloodLimits(per_source_per_s=20))  # burst 40
    flooder, bystander = await udp_peer("127.0.0.1"), await udp_peer("127.0.0.2")
    answered_before, dropped_before = _shed("503"), _shed("dropped")
    with capture_logs() as logs:
        for n in range(400):
            flooder.send(raw_request("INVITE", flooder.port, call_id=f"flood-{n}", branch=f"z9hG4bK-f{n}",
                                     user="9999", body=ANSWER_SDP), server.udp_address)
            await asyncio.sleep(0)  # let the gateway read it: a full socket buffer would drop, not shed
        bystander.send(raw_request("OPTIONS", bystander.port, branch="z9hG4bK-by"), server.udp_address)
        assert (await bystander.response()).status == 200  # its own budget: unaffected
        # the flooder's datagrams were all read before the bystander's: count what came back
        await asyncio.sleep(0)
        statuses: dict[int, int] = {}
        while not flooder.inbox.empty():
            message = parse(flooder.inbox.get_nowait())
            assert isinstance(message, SipResponse)
            statuses[message.status] = statuses.get(message.status, 0) + 1
    shed_503, dropped = _shed("503") - answered_before, _shed("dropped") - dropped_before
    admitted = len(phone.calls)
    assert 40 <= admitted <= 45  # the burst (and what refilled while the loop read them)
    assert shed_503 == statuses.get(503, 0) and 10 <= shed_503 <= 11
    assert admitted + shed_503 + dropped == 400
    events = [entry["event"] for entry in logs]
    assert events.count("sip_flood_started") == 1
    assert len(events) < 60  # one line per admitted call at most, never one per shed request
    for call in phone.calls:
        call.reject(486, "Busy Here")


async def test_retransmission_over_the_limit_is_dropped_not_refused(make_server):
    """A 503 to a retransmission would end a transaction that is already being served."""
    server, _ = await make_server(flood=FloodLimits(per_source_per_s=1))  # burst 2
    peer = await udp_peer("127.0.0.1")
    options = raw_request("OPTIONS", peer.port, call_id="first", branch="z9hG4bK-first")
    peer.send(options, server.udp_address)
    assert (await peer.response()).status == 200
    peer.send(raw_request("OPTIONS", peer.port, call_id="second", branch="z9hG4bK-second"), server.udp_address)
    assert (await peer.response()).status == 200  # the burst is spent
    dropped_before, refused_before = _shed("dropped"), _shed("503")
    for _ in range(20):
        peer.send(options, server.udp_address)
    peer.send(raw_request("OPTIONS", peer.port, call_id="other", branch="z9hG4bK-other"), server.udp_address)
    answer = await peer.response()
    assert answer.vias[0].branch == "z9hG4bK-other"  # nothing came back for the 20 retransmissions
    assert answer.status == 503 and answer.header("Retry-After")  # a new request: refused cheaply
    assert (_shed("dropped") - dropped_before, _shed("503") - refused_before) == (20, 1)
