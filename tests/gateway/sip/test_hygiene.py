"""Log and metric hygiene: counting after the allow-list, peer-chosen strings cut short in logs, and a
burst of malformed messages logged a few lines at most plus one summary."""

from __future__ import annotations

import asyncio
import ipaddress

import pytest
from structlog.testing import capture_logs

from gateway import metrics
from tests.gateway.sip.peers import ANSWER_SDP, raw_request, udp_peer

pytestmark = pytest.mark.timeout(20)


def _requests(method: str) -> float:
    return metrics.registry.get_sample_value("gateway_sip_requests_total", {"method": method}) or 0.0


async def test_requests_are_counted_after_the_allow_list(make_server):
    server, _ = await make_server(allowed_sources=(ipaddress.ip_network("127.0.0.2/32"),))
    stranger, trunk = await udp_peer("127.0.0.1"), await udp_peer("127.0.0.2")
    before_other, before_options = _requests("OTHER"), _requests("OPTIONS")
    stranger.send(raw_request("MADEUP", stranger.port, branch="z9hG4bK-s1"), server.udp_address)
    assert (await stranger.response()).status == 403
    broken = raw_request("OPTIONS", stranger.port, branch="z9hG4bK-s2").replace(b"CSeq: 1", b"CSeq: x")
    stranger.send(broken, server.udp_address)  # a stranger's garbage: not even a 400
    stranger.send(raw_request("OPTIONS", stranger.port, branch="z9hG4bK-s3", cseq=3), server.udp_address)
    assert (await stranger.response()).status == 403  # the first answer after the garbage
    trunk.send(raw_request("OPTIONS", trunk.port, branch="z9hG4bK-t1"), server.udp_address)
    assert (await trunk.response()).status == 200
    assert (_requests("OTHER"), _requests("OPTIONS")) == (before_other, before_options + 1)


async def test_peer_chosen_strings_are_cut_short_in_logs(make_server, udp_peer):
    server, phone = await make_server("reject_486")
    call_id = "c" * 250
    with capture_logs() as logs:
        udp_peer.send(raw_request("INVITE", udp_peer.port, call_id=call_id, user="9" * 300, body=ANSWER_SDP),
                      server.udp_address)
        assert (await udp_peer.response()).status == 100
        assert (await udp_peer.response()).status == 486
    assert phone.calls[0].call_id == call_id  # the dialog keeps the real one
    fields = [value for entry in logs for value in entry.values() if isinstance(value, str)]
    assert any(value.startswith("ccc") for value in fields)
    assert max(len(value) for value in fields) <= 70


async def test_a_burst_of_malformed_messages_is_logged_sparingly(make_server, udp_peer):
    server, _ = await make_server()
    before = metrics.registry.get_sample_value("gateway_sip_malformed_total") or 0.0
    with capture_logs() as logs:
        for n in range(100):
            udp_peer.send(raw_request("OPTIONS", udp_peer.port, branch=f"z9hG4bK-b{n}", extra="NoColonHere\r\n"),
                          server.udp_address)
            await asyncio.sleep(0)  # let the gateway read each: a full socket buffer would drop, not log
        for _ in range(100):
            assert (await udp_peer.response()).status == 400  # every one is still answered
        for _ in range(300):  # the summary comes with the next once-a-second sweep
            if any(entry["event"] == "sip_log_suppressed" for entry in logs):
                break
            await asyncio.sleep(0.01)
    assert metrics.registry.get_sample_value("gateway_sip_malformed_total") == before + 100
    events = [entry["event"] for entry in logs]
    assert events.count("sip_malformed") <= 10
    (summary,) = [entry for entry in logs if entry["event"] == "sip_log_suppressed"]
    assert summary["events"]["sip_malformed"] == 100 - events.count("sip_malformed")
