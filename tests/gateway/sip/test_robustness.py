"""Robustness: hundreds of torture and malformed messages (SIP and SDP) against one gateway, each
answered with its specific code or silently dropped, an OPTIONS probe after every message and a
real call (INVITE, 200, ACK, BYE) after every batch.

The corpus is data (tests/data/sip_torture/*.yaml, malformed.py); one SipServer serves the module.
Responses are matched to their case by the top Via branch, so a late retransmission of an earlier
case's answer cannot be mistaken for this one's; "drop" means no answer arrived before the probe's
(UDP from one socket on loopback arrives in order).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from gateway import metrics
from gateway.sip.message import ParseError, SipResponse, parse
from gateway.sip.rate_limit import FloodLimits
from gateway.sip.uas import Ended, SipServer, SipSettings
from tests.gateway.sip.malformed import Case, corpus_cases, generated_cases
from tests.gateway.sip.peers import ANSWER_SDP, T1, Phone, UdpPeer, raw_request

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(30)]

_serial = itertools.count()
CORPUS = corpus_cases()
GENERATED = [case for case in generated_cases() if not case.name.startswith("sdp:")]
SDP_CASES = [case for case in generated_cases() if case.name.startswith("sdp:")]


class Gateway:
    def __init__(self, server: SipServer, phone: Phone, peer: UdpPeer) -> None:
        self.server, self.phone, self.peer = server, phone, peer

    async def exchange(self, data: bytes, branch: str) -> list[SipResponse]:
        """Send `data`, then an OPTIONS probe; the final responses for `branch` that arrived first."""
        probe_branch = f"z9hG4bK-probe-{next(_serial)}"
        self.peer.send(data, self.server.udp_address)
        self.peer.send(raw_request("OPTIONS", self.peer.port, call_id=probe_branch, branch=probe_branch),
                       self.server.udp_address)
        answers: list[SipResponse] = []
        while True:
            message = _lenient(await asyncio.wait_for(self.peer.inbox.get(), 2))
            assert isinstance(message, SipResponse)
            top = message.vias[0].branch
            if top == probe_branch:
                assert message.status == 200, "the gateway stopped answering OPTIONS"
                return answers
            if top == branch and message.status >= 200:
                answers.append(message)
                cseq = (message.header("CSeq") or "").split()
                if len(cseq) == 2 and cseq[1] == "INVITE" and cseq[0].isdigit() and message.status >= 300:
                    self._ack(message, cseq[0])

    def _ack(self, response: SipResponse, number: str) -> None:
        """§17.1.1.3: the ACK for a non-2xx final response stops Timer G on the gateway."""
        via = response.header("Via") or ""
        ack = (f"ACK sip:1000@127.0.0.1 SIP/2.0\r\nVia: {via}\r\nFrom: {response.header('From')}\r\n"
               f"To: {response.header('To')}\r\nCall-ID: {response.call_id}\r\nCSeq: {number} ACK\r\n"
               "Content-Length: 0\r\n\r\n")
        self.peer.send(ack.encode("utf-8", "surrogateescape"), self.server.udp_address)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    phone = Phone("reject_486")  # a valid INVITE reaches the call layer and is declined there
    unlimited = FloodLimits(per_source_per_s=1e6, total_per_s=1e6, junk_per_source_per_s=1e6, junk_total_per_s=1e6)
    settings = SipSettings(listen_host="127.0.0.1", listen_port=0, t1=T1, t2=0.4, t4=0.25,
                           flood=unlimited)  # the corpus is not a flood
    server = SipServer(settings, phone.on_invite)
    await server.start()
    transport, peer = await asyncio.get_running_loop().create_datagram_endpoint(UdpPeer, local_addr=("127.0.0.1", 0))
    peer.transport = transport
    yield Gateway(server, phone, peer)
    transport.close()
    await server.stop()


async def check(gateway: Gateway, case: Case) -> None:
    n = next(_serial)
    branch = f"z9hG4bK-case-{n}"
    answers = await gateway.exchange(case.render(gateway.peer.port, f"case-{n}", branch), branch)
    if case.expect == "drop":
        assert answers == [], f"{case.name}: expected no answer, got {answers[0].status}"
        return
    assert answers, f"{case.name}: expected {case.expect}, got no answer"
    response = answers[0]
    assert response.status == case.expect, (case.name, response.status, response.header("Warning"))
    if response.status in (400, 488, 505):
        assert response.header("Warning"), f"{case.name}: a refusal says why"
    if response.status == 415:
        assert response.header("Accept") == "application/sdp"


async def real_call(gateway: Gateway) -> None:
    """A whole call: INVITE with SDP, 200 with an answer, ACK, BYE, and the dialog ends cleanly."""
    phone, peer, address = gateway.phone, gateway.peer, gateway.server.udp_address
    phone.policy = "accept"
    n = next(_serial)
    call_id, invite_branch = f"real-{n}", f"z9hG4bK-real-{n}"
    try:
        peer.send(raw_request("INVITE", peer.port, call_id=call_id, branch=invite_branch, body=ANSWER_SDP), address)
        ok = await _final(peer, invite_branch)
    finally:
        phone.policy = "reject_486"
    assert ok.status == 200 and ok.header("Content-Type") == "application/sdp"
    peer.send(raw_request("ACK", peer.port, call_id=call_id, branch=f"z9hG4bK-ack-{n}", to_tag=ok.to_tag), address)
    peer.send(raw_request("BYE", peer.port, call_id=call_id, branch=f"z9hG4bK-bye-{n}", cseq=2, to_tag=ok.to_tag),
              address)
    assert (await _final(peer, f"z9hG4bK-bye-{n}")).status == 200
    assert await phone.ended(phone.calls[-1]) == Ended("remote_bye")
    assert gateway.server.active_calls == 0


def _lenient(data: bytes) -> SipResponse | None:
    """Our 400 to a request without From (say) lacks From too; read it anyway."""
    try:
        message = parse(data)
    except ParseError as exc:
        message = exc.partial
    return message if isinstance(message, SipResponse) else None


async def _final(peer: UdpPeer, branch: str) -> SipResponse:
    while True:
        message = parse(await asyncio.wait_for(peer.inbox.get(), 2))
        if isinstance(message, SipResponse) and message.vias[0].branch == branch and message.status >= 200:
            return message


@pytest.mark.parametrize("case", CORPUS, ids=lambda case: case.name)
async def test_torture_corpus(gateway, case):
    await check(gateway, case)


async def test_call_works_after_the_corpus(gateway):
    await real_call(gateway)


@pytest.mark.parametrize("case", GENERATED, ids=lambda case: case.name)
async def test_generated_malformed(gateway, case):
    await check(gateway, case)


async def test_call_works_after_the_generated_messages(gateway):
    await real_call(gateway)


@pytest.mark.parametrize("case", SDP_CASES, ids=lambda case: case.name)
async def test_broken_sdp_refused_before_answer(gateway, case):
    calls_before = len(gateway.phone.calls)
    await check(gateway, case)
    assert len(gateway.phone.calls) == calls_before  # refused before the call layer saw it


async def test_call_works_after_the_broken_offers(gateway):
    await real_call(gateway)


async def test_method_label_stays_bounded(gateway):
    """40 invented methods went by above; the per-method series stay within the known set + OTHER."""
    series = {sample.labels["method"] for metric in metrics.registry.collect()
              if metric.name == "gateway_sip_requests" for sample in metric.samples
              if sample.name == "gateway_sip_requests_total"}
    assert "OTHER" in series and not any(method.startswith("FAKE") for method in series)
    assert series <= metrics.SIP_METHOD_LABELS | {"OTHER"}


async def test_merged_request_gets_482(gateway):
    """§8.2.2.2: the same INVITE (Call-ID, From tag, CSeq) again on a new branch is a merged request."""
    peer, address = gateway.peer, gateway.server.udp_address
    gateway.phone.policy = "ring"  # keep the first INVITE's transaction open
    try:
        peer.send(raw_request("INVITE", peer.port, call_id="merged", branch="z9hG4bK-m1", body=ANSWER_SDP), address)
        answers = await gateway.exchange(
            raw_request("INVITE", peer.port, call_id="merged", branch="z9hG4bK-m2", body=ANSWER_SDP), "z9hG4bK-m2")
    finally:
        gateway.phone.policy = "reject_486"
    assert [a.status for a in answers] == [482]
    assert len([c for c in gateway.phone.calls if c.call_id == "merged"]) == 1
    first = next(c for c in gateway.phone.calls if c.call_id == "merged")
    first.reject(486, "Busy Here")
    await gateway.phone.ended(first)


@pytest.mark.parametrize("body, status", [
    (ANSWER_SDP.replace("c=IN IP4 127.0.0.1", "c=IN IP4 224.0.0.9"), 488),
    (ANSWER_SDP.replace("m=audio 40000", "m=audio 70000"), 488),
    (ANSWER_SDP + "a=rtcp:70000\r\n", 488),
    (ANSWER_SDP.replace("m=audio 40000", "m=audio 65535"), 488),
    (ANSWER_SDP.split("m=")[0], 488),
])
async def test_broken_reoffer_in_a_live_call_gets_488_and_the_call_goes_on(gateway, body, status):
    phone, peer, address = gateway.phone, gateway.peer, gateway.server.udp_address
    phone.policy = "accept"
    n = next(_serial)
    call_id = f"reoffer-{n}"
    try:
        peer.send(raw_request("INVITE", peer.port, call_id=call_id, branch=f"z9hG4bK-ri-{n}", body=ANSWER_SDP), address)
        ok = await _final(peer, f"z9hG4bK-ri-{n}")
    finally:
        phone.policy = "reject_486"
    peer.send(raw_request("ACK", peer.port, call_id=call_id, branch=f"z9hG4bK-ra-{n}", to_tag=ok.to_tag), address)
    peer.send(raw_request("UPDATE", peer.port, call_id=call_id, branch=f"z9hG4bK-ru-{n}", cseq=2, to_tag=ok.to_tag,
                          body=body), address)
    refused = await _final(peer, f"z9hG4bK-ru-{n}")
    assert refused.status == status and refused.header("Warning")
    assert gateway.server.active_calls == 1
    peer.send(raw_request("BYE", peer.port, call_id=call_id, branch=f"z9hG4bK-rb-{n}", cseq=3, to_tag=ok.to_tag),
              address)
    assert (await _final(peer, f"z9hG4bK-rb-{n}")).status == 200
    assert await phone.ended(phone.calls[-1]) == Ended("remote_bye")
