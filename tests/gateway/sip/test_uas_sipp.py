"""The UAS driven by the real SIPp binary over loopback (scenarios in tests/sipp/)."""

from __future__ import annotations

import ipaddress

import pytest

from gateway import metrics
from gateway.sip.uas import Confirmed, Ended
from tests.gateway.sip.peers import ANSWER_SDP, raw_request

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(30)]


def _count(name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


async def test_basic_call_answered_confirmed_and_ended_by_caller_bye(make_server, sipp):
    server, phone = await make_server()
    rc = await sipp.run("uac_basic.xml", server.udp_address, service="4455", extra=("-d", "100"))
    assert rc == 0, sipp.last_errors
    (call,) = phone.calls
    assert call.request_user == "4455"
    assert call.invite.header("x-tts-text") == "Hello from SIPp, this is the basic call."
    assert call.transport == "udp" and call.remote_sdp is not None and "m=audio" in call.remote_sdp
    assert await phone.ended(call) == Ended("remote_bye")
    assert phone.events[call.call_id] == [Confirmed(), Ended("remote_bye")]
    assert server.active_calls == 0


async def test_basic_call_over_tcp(make_server, sipp):
    server, phone = await make_server()
    assert server.tcp_address == server.udp_address  # both transports share one port
    rc = await sipp.run("uac_basic.xml", server.tcp_address, transport="t1", extra=("-d", "100"))
    assert rc == 0, sipp.last_errors
    (call,) = phone.calls
    assert call.transport == "tcp"
    assert await phone.ended(call) == Ended("remote_bye")


async def test_gateway_hangup_sends_bye_after_ack(make_server, sipp):
    server, phone = await make_server("hangup_after_ack")
    for transport in ("u1", "t1"):
        rc = await sipp.run("uac_wait_bye.xml", server.udp_address, transport=transport)
        assert rc == 0, sipp.last_errors
    for call in phone.calls:
        assert await phone.ended(call) == Ended("local_bye")
    assert server.active_calls == 0


async def test_cancel_before_answer_gives_200_and_487(make_server, sipp):
    server, phone = await make_server("ring")
    rc = await sipp.run("uac_cancel.xml", server.udp_address)
    assert rc == 0, sipp.last_errors
    (call,) = phone.calls
    assert await phone.ended(call) == Ended("cancelled")
    assert server.active_calls == 0


async def test_options_answered_with_capabilities(make_server, sipp):
    server, _ = await make_server()
    assert await sipp.run("uac_options.xml", server.udp_address) == 0, sipp.last_errors


async def test_retransmitted_invite_makes_one_dialog(make_server, sipp):
    server, phone = await make_server("accept_later")
    rc = await sipp.run("uac_invite_retransmit.xml", server.udp_address)
    assert rc == 0, sipp.last_errors
    assert len(phone.calls) == 1
    assert await phone.ended(phone.calls[0]) == Ended("remote_bye")


async def test_lost_ack_retransmits_200_then_ends_with_bye(make_server, sipp):
    server, phone = await make_server()
    before = _count("gateway_sip_responses_total", code="200")
    rc = await sipp.run("uac_no_ack.xml", server.udp_address)
    assert rc == 0, sipp.last_errors  # SIPp got our BYE after the 200s went unacknowledged
    (call,) = phone.calls
    assert await phone.ended(call) == Ended("ack_timeout")
    assert phone.events[call.call_id] == [Ended("ack_timeout")]
    assert _count("gateway_sip_responses_total", code="200") == before + 1  # retransmissions not recounted


async def test_reinvite_sendonly_gets_recvonly_answer(make_server, sipp):
    server, phone = await make_server()
    rc = await sipp.run("uac_reinvite_sendonly.xml", server.udp_address)
    assert rc == 0, sipp.last_errors
    assert await phone.ended(phone.calls[0]) == Ended("remote_bye")


async def test_unknown_method_gets_501(make_server, sipp):
    server, _ = await make_server()
    assert await sipp.run("uac_unknown_method.xml", server.udp_address) == 0, sipp.last_errors


async def test_source_outside_allow_list_gets_403(make_server, sipp):
    server, phone = await make_server(allowed_sources=(ipaddress.ip_network("192.0.2.0/24"),))
    before = _count("gateway_sip_responses_total", code="403")
    assert await sipp.run("uac_forbidden.xml", server.udp_address) == 0, sipp.last_errors
    assert phone.calls == []
    assert _count("gateway_sip_responses_total", code="403") == before + 1


async def test_allow_list_admits_matching_source(make_server, sipp):
    server, phone = await make_server(allowed_sources=(ipaddress.ip_network("127.0.0.0/8"),))
    assert await sipp.run("uac_basic.xml", server.udp_address) == 0, sipp.last_errors
    assert len(phone.calls) == 1


async def test_invite_over_max_calls_gets_503_with_retry_after(make_server, sipp, udp_peer):
    server, phone = await make_server("ring", max_calls=1)
    # a first call that rings unanswered holds the only slot
    udp_peer.send(raw_request("INVITE", udp_peer.port, body=ANSWER_SDP), server.udp_address)
    assert (await udp_peer.response()).status == 100
    assert (await udp_peer.response()).status == 180
    assert server.active_calls == 1
    rc = await sipp.run("uac_busy.xml", server.udp_address)
    assert rc == 0, sipp.last_errors
    assert len(phone.calls) == 1


async def test_draining_refuses_new_invites_with_503(make_server, sipp):
    server, phone = await make_server()
    server.draining = True
    assert await sipp.run("uac_busy.xml", server.udp_address) == 0, sipp.last_errors
    assert phone.calls == []
