"""Flood shedding over real sockets: one source over its budget gets a few cheap 503s and silence,
counted in metrics and logged once; another source and the flooder's own transactions are unharmed.
Spoofing (issue #31 item 4): strangers are not parsed, junk with a trunk's address does not spend the
trunk's budget, a live call's requests pass while their source is over budget, and many sources together
meet a total budget."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from structlog.testing import capture_logs

from gateway import metrics
from gateway.sip.message import SipResponse, parse
from gateway.sip.rate_limit import FloodLimits
from gateway.sip.uas import Ended
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


def _count(name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def _final(peer, branch: str) -> SipResponse:
    """The first final response for `branch` (provisional ones and other transactions' answers skipped)."""
    while True:
        response = await peer.response()
        if response.vias[0].branch == branch and response.status >= 200:
            return response


async def test_strangers_are_not_parsed_and_get_few_403s(make_server):
    """Outside the allow-list: no parse (not even counted malformed), a few cheap 403s in total, the rest
    dropped; the trunk is served all along."""
    server, _ = await make_server(allowed_sources=(ipaddress.ip_network("127.0.0.2/32"),))
    stranger, trunk = await udp_peer("127.0.0.1"), await udp_peer("127.0.0.2")
    malformed_before, dropped_before = _count("gateway_sip_malformed_total"), _count(
        "gateway_sip_dropped_total", reason="not_allowed")
    started = asyncio.get_running_loop().time()
    for n in range(100):
        request = raw_request("INVITE", stranger.port, call_id=f"s{n}", branch=f"z9hG4bK-s{n}", body=ANSWER_SDP)
        stranger.send(request.replace(b"Max-Forwards: 70", b"Max-Forwards: x"), server.udp_address)
    trunk.send(raw_request("OPTIONS", trunk.port, branch="z9hG4bK-t1"), server.udp_address)
    assert (await trunk.response()).status == 200
    await asyncio.sleep(0)
    answers = []
    while not stranger.inbox.empty():
        answers.append(parse(stranger.inbox.get_nowait()))
    refilled = 10 * (asyncio.get_running_loop().time() - started)
    assert 10 <= len(answers) <= 10 + refilled + 1  # 10 at once, 10 a second, for all strangers together
    assert all(a.status == 403 and a.to_tag for a in answers)
    assert _count("gateway_sip_dropped_total", reason="not_allowed") == dropped_before + 100
    assert _count("gateway_sip_malformed_total") == malformed_before  # Max-Forwards: x was never read


async def test_junk_with_a_trunks_address_does_not_spend_its_budget(make_server):
    """300 junk datagrams carrying the trunk's address, then the trunk's own INVITEs: every one answered
    (before: the junk spent the trunk's budget and 9 of 11 INVITEs were shed)."""
    server, phone = await make_server("reject_486", flood=FloodLimits(per_source_per_s=20))  # burst 40
    spoofer, trunk = await udp_peer("127.0.0.1"), await udp_peer("127.0.0.1")
    junk_before = _count("gateway_sip_shed_total", budget="junk")
    for n in range(300):
        spoofer.send(bytes((n * 7 + i) % 256 for i in range(120)), server.udp_address)
        await asyncio.sleep(0)
    for n in range(11):
        branch = f"z9hG4bK-trunk{n}"
        trunk.send(raw_request("INVITE", trunk.port, call_id=f"trunk-{n}", branch=branch, body=ANSWER_SDP),
                   server.udp_address)
        assert (await _final(trunk, branch)).status == 486  # the call layer's answer, not a 503
    assert len(phone.calls) == 11
    assert _count("gateway_sip_shed_total", budget="junk") - junk_before >= 300 - 20 - 1  # junk burst: 20
    assert spoofer.inbox.empty()  # junk is never answered with a 503


async def test_live_calls_requests_pass_while_their_source_is_over_budget(make_server):
    """A flood from the trunk's address spends its budget; the live call's re-INVITE, ACK and BYE still
    pass (found by Call-ID before parsing); a new call is shed cheaply, and served once the flood ends."""
    server, phone = await make_server(flood=FloodLimits(per_source_per_s=10))  # burst 20
    trunk, flooder = await udp_peer("127.0.0.1"), await udp_peer("127.0.0.1")
    trunk.send(raw_request("INVITE", trunk.port, call_id="live", branch="z9hG4bK-l1", body=ANSWER_SDP),
               server.udp_address)
    ok = await _final(trunk, "z9hG4bK-l1")
    assert ok.status == 200
    trunk.send(raw_request("ACK", trunk.port, call_id="live", branch="z9hG4bK-l2", to_tag=ok.to_tag),
               server.udp_address)
    shed_before = _count("gateway_sip_shed_total", budget="requests")
    for n in range(200):
        flooder.send(raw_request("OPTIONS", flooder.port, call_id=f"f{n}", branch=f"z9hG4bK-f{n}"),
                     server.udp_address)
        await asyncio.sleep(0)
    trunk.send(raw_request("INVITE", trunk.port, call_id="new", branch="z9hG4bK-n1", body=ANSWER_SDP),
               server.udp_address)  # over budget: a new call is shed (its 503s were spent by the flood)
    reinvite = raw_request("INVITE", trunk.port, call_id="live", branch="z9hG4bK-l3", cseq=2, to_tag=ok.to_tag,
                           body=ANSWER_SDP.replace("a=sendrecv", "a=sendonly"))
    trunk.send(reinvite, server.udp_address)
    assert (await _final(trunk, "z9hG4bK-l3")).status == 200
    answered = [parse(flooder.inbox.get_nowait()).status for _ in range(flooder.inbox.qsize())]
    assert 15 <= answered.count(200) < 40 and answered.count(503) == 10  # burst 20, less the call's INVITE and ACK
    shed = _count("gateway_sip_shed_total", budget="requests") - shed_before
    assert shed == 200 - answered.count(200) + 1  # the flood's and the new INVITE, none of the live call's
    assert [call.call_id for call in phone.calls] == ["live"]
    trunk.send(raw_request("BYE", trunk.port, call_id="live", branch="z9hG4bK-l4", cseq=3, to_tag=ok.to_tag),
               server.udp_address)
    assert (await _final(trunk, "z9hG4bK-l4")).status == 200
    assert await phone.ended(phone.calls[0]) == Ended("remote_bye")
    await asyncio.sleep(0.3)  # the flood is over: the budget refills at 10 a second
    trunk.send(raw_request("INVITE", trunk.port, call_id="after", branch="z9hG4bK-a1", body=ANSWER_SDP),
               server.udp_address)
    assert (await _final(trunk, "z9hG4bK-a1")).status == 200


async def test_total_budget_bounds_many_sources_together(make_server):
    """50 sources each within their own budget, together over the total: the rest is shed, 503s are
    bounded in total, and the trunk's live call still ends normally."""
    server, phone = await make_server("reject_486", flood=FloodLimits(per_source_per_s=20, total_per_s=50))
    trunk = await udp_peer("127.0.0.1")
    trunk.send(raw_request("INVITE", trunk.port, call_id="live", branch="z9hG4bK-l1", body=ANSWER_SDP),
               server.udp_address)
    assert (await _final(trunk, "z9hG4bK-l1")).status == 486
    phone.policy = "accept"
    trunk.send(raw_request("INVITE", trunk.port, call_id="live2", branch="z9hG4bK-l2", body=ANSWER_SDP),
               server.udp_address)
    ok = await _final(trunk, "z9hG4bK-l2")
    trunk.send(raw_request("ACK", trunk.port, call_id="live2", branch="z9hG4bK-l2a", to_tag=ok.to_tag),
               server.udp_address)
    sources = [await udp_peer(f"127.0.0.{10 + i}") for i in range(50)]
    phone.policy = "reject_486"
    calls_before, total_before = len(phone.calls), _count("gateway_sip_shed_total", budget="requests_total")
    started = asyncio.get_running_loop().time()
    for n in range(15):
        for i, source in enumerate(sources):  # 750 INVITEs, 15 per source: each within its burst of 40
            source.send(raw_request("INVITE", source.port, call_id=f"m{i}-{n}", branch=f"z9hG4bK-m{i}x{n}",
                                    body=ANSWER_SDP), server.udp_address)
            await asyncio.sleep(0)  # let the gateway read it: a full socket buffer would drop, not shed
    trunk.send(raw_request("BYE", trunk.port, call_id="live2", branch="z9hG4bK-l3", cseq=2, to_tag=ok.to_tag),
               server.udp_address)
    assert (await _final(trunk, "z9hG4bK-l3")).status == 200
    admitted = len(phone.calls) - calls_before
    refilled = 50 * (asyncio.get_running_loop().time() - started)
    assert 100 <= admitted <= 100 + refilled + 1  # of 750: the total's burst and what refilled meanwhile
    assert _count("gateway_sip_shed_total", budget="requests_total") - total_before == 750 - admitted
    refused = sum(parse(source.inbox.get_nowait()).status == 503 for source in sources
                  for _ in range(source.inbox.qsize()))
    assert 0 < refused <= 60  # cheap 503s: 50 a second in total, not 10 for each of the 50 sources
