"""Session timers (RFC 4028) and overlapping re-INVITEs (RFC 3261 §14.2, #32 item 6) against a real `serve`
(eSpeak NG engine) with SIPp callers over loopback: the caller refreshes and the call stays up with its RTP
undisturbed; a caller that never refreshes gets our BYE before expiry; as refresher we send the re-INVITE
ourselves; too small a Session-Expires gets 422 with our Min-SE; an overlapping re-INVITE gets 491. A plain
call is placed after each to show the gateway carries on.
"""

from __future__ import annotations

import shutil
from datetime import datetime
from pathlib import Path

import pytest

from integration_harness import SCENARIOS, rtp_recorder, run_sipp, sipp_messages
from serve_process import ServeProcess, healthy_serve

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed"),
              pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")]

# Seconds, not minutes, so each test takes a few: min_se_s 2 is far below RFC 4028's 90 on purpose.
CONFIG = """
sip: {t1_ms: 50, session_timers: {expires_s: 6, min_se_s: 2}}
media: {rtp_port_range: 47000-47999}
"""
LONG_TEXT = ("Thank you for calling the speech gateway. This prompt is long on purpose, so that the caller can "
             "refresh the session twice while it is still being spoken, and hear every word of it without a gap.")


@pytest.fixture
async def serve(tmp_path):
    async with healthy_serve(tmp_path, CONFIG, "espeak") as process:
        yield process


def _logged_at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


async def _call(serve: ServeProcess, scenario: str, workdir: Path, text: str = "Hello.", **keys):
    recorder = await rtp_recorder()
    workdir.mkdir(exist_ok=True)
    rc, errors = await run_sipp(SCENARIOS / scenario, serve.sip_address, workdir, trace_msg=True,
                                keys={"text": text, "rtp_rx": str(recorder.port), "codec_pt": "0",
                                      "codec_name": "PCMU", **keys})
    recorder.transport.close()
    assert rc == 0, errors
    return recorder


async def _plain_call_works(serve: ServeProcess, workdir: Path) -> None:
    recorder = await _call(serve, "gw_listen.xml", workdir / "plain", "Still here.")
    assert len(recorder.packets) > 10


async def test_caller_refreshes_and_the_call_stays_up_with_rtp_undisturbed(serve, tmp_path):
    recorder = await _call(serve, "gw_timer_uac_refresh.xml", tmp_path / "call", LONG_TEXT)
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "caller_hangup"  # the caller's BYE ended it, 4.5 s into a 4 s session
    assert not any(e.get("event") == "session_timer_expired" for e in serve.log_events())
    packets = recorder.packets
    assert len(packets) > 200  # spoke through both refreshes
    # The refresh re-INVITEs (unchanged SDP) changed nothing on the stream: one talkspurt, continuous.
    assert len({p.ssrc for p in packets}) == 1
    assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    assert sum(p.marker for p in packets) == 1
    await _plain_call_works(serve, tmp_path)


async def test_a_session_nobody_refreshes_ends_with_our_bye_before_expiry(serve, tmp_path):
    await _call(serve, "gw_timer_expiry.xml", tmp_path / "call")
    answered = await serve.wait_for_event("answered")
    expired = await serve.wait_for_event("session_timer_expired")
    bye = await serve.wait_for_event("sip_bye_sent")
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "session_expired"
    # RFC 4028 §10: BYE at expiry - min(32, 3/3) = 2 s after the 200, before the 3 s run out.
    assert 1.5 < _logged_at(expired) - _logged_at(answered) < 3.0
    assert _logged_at(bye) - _logged_at(answered) < 3.0
    await _plain_call_works(serve, tmp_path)


async def test_as_refresher_we_send_the_refresh_and_an_overlapping_reinvite_gets_491(serve, tmp_path):
    await _call(serve, "gw_timer_uas_refresh.xml", tmp_path / "call")
    messages = sipp_messages(tmp_path / "call")
    refresh = messages[messages.index("INVITE sip:sipp@"):]
    assert "Session-Expires: 4;refresher=uas" in refresh.split("\n\n", 1)[0]
    assert "SIP/2.0 491 Request Pending" in messages
    pending = await serve.wait_for_event("sip_request_pending")
    assert pending["method"] == "INVITE"
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "caller_hangup"
    await _plain_call_works(serve, tmp_path)


async def test_as_refresher_we_refresh_with_update_when_the_caller_allows_it(serve, tmp_path):
    await _call(serve, "gw_timer_uas_update.xml", tmp_path / "call")
    messages = sipp_messages(tmp_path / "call")
    update = messages[messages.index("UPDATE sip:sipp@"):].split("\n\n", 1)[0]
    assert "Session-Expires: 4;refresher=uas" in update and "Content-Length: 0" in update
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "caller_hangup"
    await _plain_call_works(serve, tmp_path)


async def test_too_small_session_expires_gets_422_with_our_min_se(serve, tmp_path):
    await _call(serve, "gw_timer_too_small.xml", tmp_path / "call")
    messages = sipp_messages(tmp_path / "call")
    assert "SIP/2.0 422 Session Interval Too Small" in messages
    assert "Min-SE: 2" in messages
    await _plain_call_works(serve, tmp_path)


async def test_overlapping_reinvites_from_the_caller_get_491(serve, tmp_path):
    await _call(serve, "gw_reinvite_overlap.xml", tmp_path / "call")
    assert "SIP/2.0 491 Request Pending" in sipp_messages(tmp_path / "call")
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "caller_hangup"
    await _plain_call_works(serve, tmp_path)
