"""Reliable provisional responses (RFC 3262) and the minute refresh of an unanswered call (RFC 3261
§13.3.1.1), against a real SipServer over loopback UDP with a hand-written caller. T1 is 50 ms."""

from __future__ import annotations

import asyncio

from gateway.sip import provisional
from tests.gateway.sip.peers import T1, raw_request

SDP = "v=0\r\no=c 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio 40002 RTP/AVP 0\r\n"


def _invite(port: int, extra: str = "") -> bytes:
    return raw_request("INVITE", port, call_id="rel-1", branch="z9hG4bK-rel-1", body=SDP, extra=extra)


def _prack(port: int, tag: str, rack: str, cseq: int, branch: str) -> bytes:
    return raw_request("PRACK", port, call_id="rel-1", branch=branch, cseq=cseq, to_tag=tag, extra=f"RAck: {rack}\r\n")


async def _responses_for(peer, seconds: float) -> list:
    """Every response that arrives within the next `seconds`."""
    got = []
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while (left := deadline - asyncio.get_running_loop().time()) > 0:
            got.append(await peer.response(timeout=left))
    except TimeoutError:
        pass
    return got


async def test_reliable_183_is_resent_until_its_prack_and_a_wrong_rack_gets_481(make_server, udp_peer):
    server, phone = await make_server("early")
    udp_peer.send(_invite(udp_peer.port, "Require: 100rel\r\n"), server.udp_address)
    assert (await udp_peer.response()).status == 100
    first = await udp_peer.response()
    assert first.status == 183 and first.header("Require") == "100rel" and b"m=audio" in first.body
    rseq = int(first.header("RSeq"))
    assert 1 <= rseq < 2**31
    resent = await _responses_for(udp_peer, 4 * T1)  # T1, 2T1, 4T1 ...: resent while no PRACK comes
    assert len(resent) >= 2 and all(r.status == 183 and r.header("RSeq") == str(rseq) for r in resent)
    tag = first.to_tag
    udp_peer.send(_prack(udp_peer.port, tag, f"{rseq + 1} 1 INVITE", 2, "z9hG4bK-p1"), server.udp_address)
    assert (await _first_non_183(udp_peer)).status == 481
    udp_peer.send(_prack(udp_peer.port, tag, f"{rseq} 1 INVITE", 3, "z9hG4bK-p2"), server.udp_address)
    assert (await _first_non_183(udp_peer)).status == 200
    assert await _responses_for(udp_peer, 8 * T1) == []  # acknowledged: no more 183s
    assert server.active_calls == 1


async def _first_non_183(peer):
    while True:
        response = await peer.response()
        if response.status != 183:
            return response


async def test_no_prack_within_64_t1_ends_the_call_with_504(make_server, udp_peer):
    server, phone = await make_server("early")
    udp_peer.send(_invite(udp_peer.port, "Supported: 100rel\r\n"), server.udp_address)
    final = await _first_non_183(udp_peer)  # 100 Trying first
    final = await _first_non_183(udp_peer) if final.status == 100 else final
    assert final.status == 504
    assert (await phone.ended(phone.calls[0])).reason == "prack_timeout"


async def test_unanswered_early_media_sends_a_provisional_again_each_interval(make_server, udp_peer, monkeypatch):
    monkeypatch.setattr(provisional, "PROVISIONAL_REFRESH_S", 4 * T1)  # a minute, scaled down
    server, phone = await make_server("early")
    udp_peer.send(_invite(udp_peer.port), server.udp_address)  # no 100rel: the same 183 again
    assert (await udp_peer.response()).status == 100
    first = await udp_peer.response()
    assert first.status == 183 and first.header("RSeq") is None
    again = await _responses_for(udp_peer, 10 * T1)
    assert len(again) >= 2 and all(r == first for r in again)
    phone.calls[0].reject(480, "Temporarily Unavailable")
    assert (await _first_non_183(udp_peer)).status == 480
    assert all(r.status == 480 for r in await _responses_for(udp_peer, 10 * T1))  # no 183 after the final


async def test_reliable_refresh_is_a_new_183_with_the_next_rseq_once_the_last_was_pracked(
        make_server, udp_peer, monkeypatch):
    monkeypatch.setattr(provisional, "PROVISIONAL_REFRESH_S", 4 * T1)
    server, phone = await make_server("early")
    udp_peer.send(_invite(udp_peer.port, "Supported: 100rel\r\n"), server.udp_address)
    assert (await udp_peer.response()).status == 100
    first = await udp_peer.response()
    rseq = int(first.header("RSeq"))
    udp_peer.send(_prack(udp_peer.port, first.to_tag, f"{rseq} 1 INVITE", 2, "z9hG4bK-p3"), server.udp_address)
    assert (await _first_non_183(udp_peer)).status == 200
    refresh = await asyncio.wait_for(_next_183_with_rseq(udp_peer, rseq + 1), 10 * T1)
    assert refresh.body == b""  # the answer stands; the refresh carries none
    phone.calls[0].reject(480, "Temporarily Unavailable")


async def _next_183_with_rseq(peer, rseq: int):
    while True:
        response = await peer.response()
        if response.status == 183 and response.header("RSeq") == str(rseq):
            return response
