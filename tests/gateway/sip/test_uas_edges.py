"""UAS edge cases with hand-written datagrams over loopback: garbage, malformed requests, policy
codes (400/405/481/483/488/420: 100rel and timer are served), in-dialog UPDATE/INFO/OPTIONS, and TCP framing."""

from __future__ import annotations

import asyncio

import pytest

from gateway import metrics
from gateway.sip.message import SipResponse, parse
from gateway.sip.uas import Confirmed, Ended
from tests.gateway.sip.peers import ANSWER_SDP, raw_request

pytestmark = pytest.mark.timeout(20)


def _malformed() -> float:
    return metrics.registry.get_sample_value("gateway_sip_malformed_total") or 0.0


async def _answered_call(server, phone, peer, call_id: str = "raw-call-1"):
    """INVITE from the raw peer, answered by the phone and ACKed; returns (call, 200 OK)."""
    peer.send(raw_request("INVITE", peer.port, call_id=call_id, branch=f"z9hG4bK-{call_id}", body=ANSWER_SDP),
              server.udp_address)
    assert (await peer.response()).status == 100
    ok = await peer.response()
    assert ok.status == 200 and ok.header("Content-Type") == "application/sdp"
    peer.send(raw_request("ACK", peer.port, call_id=call_id, branch="z9hG4bK-ack", to_tag=ok.to_tag),
              server.udp_address)
    return phone.calls[-1], ok


async def test_garbage_and_malformed_invite_then_a_valid_call_works(make_server, udp_peer):
    server, phone = await make_server()
    before = _malformed()
    udp_peer.send(b"\x16\x03\x01\x02\x00not sip at all", server.udp_address)  # unanswerable: dropped
    udp_peer.send(b"\r\n\r\n", server.udp_address)  # RFC 5626 keep-alive: not an error
    bad = raw_request("INVITE", udp_peer.port, call_id="bad-1", body=ANSWER_SDP)
    udp_peer.send(bad.replace(b"Content-Length: ", b"Content-Length: 9"), server.udp_address)
    response = await udp_peer.response()  # the garbage got no answer, so this is the first datagram
    assert (response.status, response.call_id, response.cseq) == (400, "bad-1", (1, "INVITE"))
    assert response.vias[0].branch == "z9hG4bK-raw-1" and response.vias[0].param("rport") == str(udp_peer.port)
    assert "exceeds body" in (response.header("Warning") or "")
    assert _malformed() == before + 2
    assert phone.calls == [] and server.active_calls == 0

    call, ok = await _answered_call(server, phone, udp_peer)
    udp_peer.send(raw_request("BYE", udp_peer.port, branch="z9hG4bK-bye", cseq=2, to_tag=ok.to_tag),
                  server.udp_address)
    assert (await udp_peer.response()).status == 200
    assert await phone.ended(call) == Ended("remote_bye")
    assert phone.events[call.call_id] == [Confirmed(), Ended("remote_bye")]
    assert server.active_calls == 0


async def test_missing_call_id_still_gets_400(make_server, udp_peer):
    server, _ = await make_server()
    data = raw_request("OPTIONS", udp_peer.port).replace(b"Call-ID: raw-call-1\r\n", b"")
    udp_peer.send(data, server.udp_address)
    raw = await asyncio.wait_for(udp_peer.inbox.get(), 2)
    assert raw.startswith(b"SIP/2.0 400 Bad Request\r\n") and b"branch=z9hG4bK-raw-1" in raw


async def test_policy_codes(make_server, udp_peer):
    server, _ = await make_server()
    cases = [
        (raw_request("OPTIONS", udp_peer.port, branch="z9hG4bK-a").replace(b"Max-Forwards: 70", b"Max-Forwards: 0"), 483),
        (raw_request("REGISTER", udp_peer.port, branch="z9hG4bK-b"), 405),
        (raw_request("SUBSCRIBE", udp_peer.port, branch="z9hG4bK-c"), 405),
        (raw_request("PRACK", udp_peer.port, branch="z9hG4bK-d"), 481),  # RFC 3262: implemented, no dialog
        (raw_request("BYE", udp_peer.port, branch="z9hG4bK-e", to_tag="nope"), 481),
        (raw_request("INFO", udp_peer.port, branch="z9hG4bK-f"), 481),
        (raw_request("CANCEL", udp_peer.port, branch="z9hG4bK-g"), 481),
        (raw_request("INVITE", udp_peer.port, branch="z9hG4bK-h", extra="Require: 100rel, foo\r\n"), 420),
    ]
    for data, status in cases:
        udp_peer.send(data, server.udp_address)
        response = await udp_peer.response()
        assert response.status == status, (data.split(b"\r\n")[0], response.status)
        if status == 405:
            assert "INVITE" in (response.header("Allow") or "")
        if status == 420:  # §8.2.2.3: only what we lack; 100rel (RFC 3262) we serve
            assert response.header("Unsupported") == "foo"
    assert server.active_calls == 0


async def test_retransmitted_request_is_answered_from_the_transaction(make_server, udp_peer):
    server, _ = await make_server()
    before = metrics.registry.get_sample_value("gateway_sip_responses_total", {"code": "405"}) or 0.0
    data = raw_request("MESSAGE", udp_peer.port, branch="z9hG4bK-m")
    udp_peer.send(data, server.udp_address)
    first = await udp_peer.response()
    udp_peer.send(data, server.udp_address)
    again = await udp_peer.response()
    assert first == again and first.status == 405  # same bytes, same To tag
    assert metrics.registry.get_sample_value("gateway_sip_responses_total", {"code": "405"}) == before + 1


async def test_in_dialog_update_info_options_and_refused_offer(make_server, udp_peer):
    server, phone = await make_server()
    call, ok = await _answered_call(server, phone, udp_peer)
    tag = ok.to_tag
    hold = ANSWER_SDP.replace("a=sendrecv", "a=sendonly")
    udp_peer.send(raw_request("UPDATE", udp_peer.port, branch="z9hG4bK-u1", cseq=2, to_tag=tag, body=hold),
                  server.udp_address)
    update_ok = await udp_peer.response()
    assert update_ok.status == 200 and b"a=recvonly" in update_ok.body
    udp_peer.send(raw_request("INFO", udp_peer.port, branch="z9hG4bK-i1", cseq=3, to_tag=tag), server.udp_address)
    assert (await udp_peer.response()).status == 200
    udp_peer.send(raw_request("OPTIONS", udp_peer.port, branch="z9hG4bK-o1", cseq=4, to_tag=tag),
                  server.udp_address)
    assert (await udp_peer.response()).status == 200
    call.offer_handler = lambda offer: None
    udp_peer.send(raw_request("UPDATE", udp_peer.port, branch="z9hG4bK-u2", cseq=5, to_tag=tag, body=hold),
                  server.udp_address)
    assert (await udp_peer.response()).status == 488
    udp_peer.send(raw_request("INFO", udp_peer.port, branch="z9hG4bK-i2", cseq=1, to_tag=tag), server.udp_address)
    assert (await udp_peer.response()).status == 500  # CSeq went backwards (§12.2.2)
    assert server.active_calls == 1


async def test_hangup_before_ack_waits_for_the_ack(make_server, udp_peer):
    server, phone = await make_server("accept")
    udp_peer.send(raw_request("INVITE", udp_peer.port, body=ANSWER_SDP), server.udp_address)
    assert (await udp_peer.response()).status == 100
    ok = await udp_peer.response()
    call = phone.calls[0]
    call.hangup()  # before the ACK: no BYE may go out yet (§15)
    call.hangup()  # idempotent
    udp_peer.send(raw_request("ACK", udp_peer.port, branch="z9hG4bK-ack", to_tag=ok.to_tag), server.udp_address)
    bye = parse(await asyncio.wait_for(udp_peer.inbox.get(), 2))
    assert bye.method == "BYE" and bye.to_tag == "raw-tag" and bye.from_tag == ok.to_tag
    assert bye.uri == f"sip:raw@127.0.0.1:{udp_peer.port}"  # the remote target is the INVITE's Contact
    reply = SipResponse(status=200, reason="OK", headers=tuple(
        (name, bye.header(name) or "") for name in ("Via", "From", "To", "Call-ID", "CSeq")))
    udp_peer.send(reply.serialize(), server.udp_address)
    assert await phone.ended(call) == Ended("local_bye")
    assert phone.events[call.call_id] == [Confirmed(), Ended("local_bye")]


async def test_unanswered_bye_times_out(make_server, udp_peer):
    server, phone = await make_server("hangup_after_ack")
    await _answered_call(server, phone, udp_peer)
    first = parse(await asyncio.wait_for(udp_peer.inbox.get(), 2))
    again = parse(await asyncio.wait_for(udp_peer.inbox.get(), 2))  # Timer E retransmission
    assert first == again and first.method == "BYE"
    assert await phone.ended(phone.calls[0]) == Ended("bye_timeout")  # Timer F = 64*T1


async def test_reject_sends_final_and_ends(make_server, udp_peer):
    server, phone = await make_server("reject_486")
    udp_peer.send(raw_request("INVITE", udp_peer.port, body=ANSWER_SDP), server.udp_address)
    assert (await udp_peer.response()).status == 100
    busy = await udp_peer.response()
    assert busy.status == 486
    again = await udp_peer.response()  # Timer G retransmits the 486 until the ACK
    assert again == busy
    udp_peer.send(raw_request("ACK", udp_peer.port, to_tag=busy.to_tag), server.udp_address)
    assert await phone.ended(phone.calls[0]) == Ended("rejected")
    assert server.active_calls == 0


async def test_tcp_framing_split_and_pipelined_messages(make_server):
    server, _ = await make_server()
    reader, writer = await asyncio.open_connection(*server.tcp_address)
    port = writer.get_extra_info("sockname")[1]
    first = raw_request("OPTIONS", port, branch="z9hG4bK-t1").replace(b"SIP/2.0/UDP", b"SIP/2.0/TCP")
    second = raw_request("OPTIONS", port, branch="z9hG4bK-t2", cseq=2).replace(b"SIP/2.0/UDP", b"SIP/2.0/TCP")
    writer.write(b"\r\n\r\n" + first[:40])  # keep-alive ping, then a message split across writes
    await writer.drain()
    assert await asyncio.wait_for(reader.readexactly(2), 2) == b"\r\n"  # RFC 5626 pong
    writer.write(first[40:] + second)
    await writer.drain()
    branches = []
    for _ in range(2):
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
        response = parse(head, stream=True)
        assert response.status == 200
        branches.append(response.vias[0].branch)
    assert branches == ["z9hG4bK-t1", "z9hG4bK-t2"]
    writer.close()


async def test_after_a_trunk_reload_a_live_call_from_a_removed_address_can_still_hang_up(make_server, udp_peer):
    """SIGHUP replaces sip.settings.allowed_sources (Gateway.reconfigure); the dialogs admitted before must
    still end (§15) and be cancelled (§9.2), while new requests from the removed address get 403."""
    import dataclasses
    import ipaddress

    server, phone = await make_server(allowed_sources=(ipaddress.ip_network("127.0.0.0/8"),))
    call, ok = await _answered_call(server, phone, udp_peer)
    phone.policy = "ring"
    udp_peer.send(raw_request("INVITE", udp_peer.port, call_id="ringing", branch="z9hG4bK-ring", body=ANSWER_SDP),
                  server.udp_address)
    assert [(await udp_peer.response()).status for _ in range(2)] == [100, 180]
    ringing = phone.calls[-1]

    server.settings = dataclasses.replace(server.settings, allowed_sources=(ipaddress.ip_network("192.0.2.0/24"),))
    udp_peer.send(raw_request("OPTIONS", udp_peer.port, call_id="new-opt", branch="z9hG4bK-opt"), server.udp_address)
    assert (await udp_peer.response()).status == 403
    udp_peer.send(raw_request("INVITE", udp_peer.port, call_id="new-inv", branch="z9hG4bK-new", body=ANSWER_SDP),
                  server.udp_address)
    forbidden = await udp_peer.response()
    assert forbidden.status == 403
    udp_peer.send(raw_request("ACK", udp_peer.port, call_id="new-inv", branch="z9hG4bK-new",  # stops Timer G
                              to_tag=forbidden.to_tag), server.udp_address)
    udp_peer.send(raw_request("BYE", udp_peer.port, call_id="no-such-dialog", branch="z9hG4bK-x", cseq=2,
                              to_tag="forged"), server.udp_address)
    assert (await udp_peer.response()).status == 403  # a to-tag alone does not open the door

    udp_peer.send(raw_request("BYE", udp_peer.port, branch="z9hG4bK-bye", cseq=2, to_tag=ok.to_tag),
                  server.udp_address)
    assert (await udp_peer.response()).status == 200
    assert await phone.ended(call) == Ended("remote_bye")
    cancel = raw_request("CANCEL", udp_peer.port, call_id="ringing", branch="z9hG4bK-ring")
    udp_peer.send(cancel, server.udp_address)
    answers = sorted([await udp_peer.response() for _ in range(2)], key=lambda response: response.status)
    assert [response.status for response in answers] == [200, 487]
    udp_peer.send(raw_request("ACK", udp_peer.port, call_id="ringing", branch="z9hG4bK-ring",
                              to_tag=answers[1].to_tag), server.udp_address)  # the ACK of the 487: absorbed too
    assert await phone.ended(ringing) == Ended("cancelled")
    assert server.active_calls == 0

    server.settings = dataclasses.replace(server.settings, allowed_sources=(ipaddress.ip_network("127.0.0.0/8"),))
    phone.policy = "accept"
    call, ok = await _answered_call(server, phone, udp_peer, "after")  # a normal call works afterwards
    udp_peer.send(raw_request("BYE", udp_peer.port, call_id="after", branch="z9hG4bK-bye2", cseq=2, to_tag=ok.to_tag),
                  server.udp_address)
    assert (await udp_peer.response()).status == 200


async def test_max_calls_counts_a_call_until_its_call_layer_is_done_not_only_its_dialog(make_server, udp_peer):
    """A call whose BYE has arrived but whose session is still closing its media is still a call: with
    max_calls 1 the next INVITE gets 503 until the session's task is done (calls_active reached 51 of 50)."""
    server, phone = await make_server(max_calls=1, retry_after_s=7)
    sessions: list[asyncio.Future] = []

    def on_invite(call):
        phone.on_invite(call)
        sessions.append(asyncio.get_running_loop().create_future())
        return sessions[-1]

    server._on_invite = on_invite
    call, ok = await _answered_call(server, phone, udp_peer)
    udp_peer.send(raw_request("BYE", udp_peer.port, branch="z9hG4bK-bye", cseq=2, to_tag=ok.to_tag),
                  server.udp_address)
    assert (await udp_peer.response()).status == 200
    assert await phone.ended(call) == Ended("remote_bye")
    assert server.active_calls == 1  # the session has not finished yet
    udp_peer.send(raw_request("INVITE", udp_peer.port, call_id="second", branch="z9hG4bK-2", body=ANSWER_SDP),
                  server.udp_address)
    refused = await udp_peer.response()
    assert (refused.status, refused.header("Retry-After")) == (503, "7")
    sessions[0].set_result("caller_hangup")
    await asyncio.sleep(0)
    assert server.active_calls == 0
    udp_peer.send(raw_request("INVITE", udp_peer.port, call_id="third", branch="z9hG4bK-3", body=ANSWER_SDP),
                  server.udp_address)
    assert [(await udp_peer.response()).status for _ in range(2)] == [100, 200]
    assert server.active_calls == 1
