"""Early media (#32 item 3) against a real `serve` (eSpeak NG engine), with SIPp callers over loopback:
183 Session Progress with SDP and RTP before the 200 (then answer, reject or ring, as the route says),
PRACK for a reliable 183 (RFC 3262), CANCEL while ringing in early media (487). A plain call is placed
after each to show the gateway carries on.

When RTP arrived is compared with when the gateway answered through the gateway's own log (its
`answered` event's UTC timestamp) against the recorder's wall-clock arrival times.
"""

from __future__ import annotations

import shutil
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp, sipp_messages
from serve_process import ServeProcess, healthy_serve

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed"),
              pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng not installed")]

EARLY_TEXT = "Calls to this number may be recorded. Please hold the line while we connect you."
CONFIG = f"""
sip: {{t1_ms: 50}}
media: {{rtp_port_range: 46000-46999}}
routes:
  - {{match: "3001", text: "{EARLY_TEXT}", early_media: answer}}
  - {{match: "3002", text: "The number you have dialled is not available.", early_media: reject, reject_code: 486}}
  - {{match: "3003", text: "Please keep ringing.", early_media: ring}}
"""


@pytest.fixture
async def serve(tmp_path):
    async with healthy_serve(tmp_path, CONFIG, "espeak") as process:
        yield process


def _wall_clock(packets) -> list[float]:
    """The recorder's monotonic arrival times as UTC epoch seconds (the log's clock)."""
    offset = time.time() - time.monotonic()
    return [p.at + offset for p in packets]


def _logged_at(event: dict) -> float:
    return datetime.fromisoformat(event["timestamp"].replace("Z", "+00:00")).timestamp()


def _rms(recorder, packets) -> float:
    from speech_audio import g711

    audio = g711.decode(b"".join(p.payload for p in packets), "PCMU").astype(np.float64)
    return float(np.sqrt(np.mean(audio ** 2))) if len(audio) else 0.0


def _one_stream(packets) -> None:
    """One RTP stream, one talkspurt: sequence numbers and timestamps continuous (RFC 3550 §5.1)."""
    assert len({p.ssrc for p in packets}) == 1
    assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    assert packets[0].marker and not any(p.marker for p in packets[1:])


async def _plain_call_works(serve: ServeProcess, workdir: Path) -> None:
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", serve.sip_address, workdir / "plain", keys={
        "text": "Still here.", "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    assert len(recorder.packets) > 10


async def _sipp(serve, scenario, workdir, service, recorder, **keys):
    workdir.mkdir(exist_ok=True)
    return await run_sipp(SCENARIOS / scenario, serve.sip_address, workdir, service=service, trace_msg=True,
                          keys={"rtp_rx": str(recorder.port), **keys})


async def test_early_media_then_answer_speaks_before_the_200_on_one_stream(serve, tmp_path):
    (tmp_path / "plain").mkdir()
    recorder = await rtp_recorder()
    rc, errors = await _sipp(serve, "gw_early_answer.xml", tmp_path / "call", "3001", recorder)
    recorder.transport.close()
    assert rc == 0, errors
    early = await serve.wait_for_event("sip_early_media")
    answered = await serve.wait_for_event("answered")
    packets = recorder.packets
    arrived = _wall_clock(packets)
    before_200 = [p for p, at in zip(packets, arrived) if at < _logged_at(answered)]
    assert len(before_200) > 100  # seconds of speech before the 200 OK ...
    assert _rms(recorder, before_200) > 500  # ... and it is speech, far above G.711 silence
    assert _logged_at(early) <= arrived[0]
    _one_stream(packets)
    assert (await serve.wait_for_event("call_ended"))["outcome"] == "completed"
    messages = sipp_messages(tmp_path / "call")
    ok = messages[messages.index("SIP/2.0 200 OK"):]
    progress = messages[messages.index("SIP/2.0 183 Session Progress"):]
    # The 200 carries the very SDP of the 183 (same o= version: the same session goes on).
    assert progress.split("\n\n", 1)[1].split("v=0", 1)[1][:200] == ok.split("v=0", 1)[1][:200]
    await _plain_call_works(serve, tmp_path)


async def test_early_media_then_reject_with_the_configured_code(serve, tmp_path):
    (tmp_path / "plain").mkdir()
    recorder = await rtp_recorder()
    rc, errors = await _sipp(serve, "gw_early_reject.xml", tmp_path / "call", "3002", recorder)
    recorder.transport.close()
    assert rc == 0, errors
    assert len(recorder.packets) > 50 and _rms(recorder, recorder.packets) > 500
    rejected = await serve.wait_for_event("rejected")
    assert rejected["status"] == 486
    assert (await serve.wait_for_event("call_ended"))["outcome"] == "announced_reject"
    assert _wall_clock(recorder.packets)[-1] <= _logged_at(rejected) + 0.05  # the announcement, then the 486
    await _plain_call_works(serve, tmp_path)


async def test_early_media_ring_keeps_ringing_until_cancel_then_487(serve, tmp_path):
    (tmp_path / "plain").mkdir()
    recorder = await rtp_recorder()
    rc, errors = await _sipp(serve, "gw_early_ring_cancel.xml", tmp_path / "call", "3003", recorder)
    assert rc == 0, errors  # no final response before the CANCEL: SIPp would have failed on it
    count = len(recorder.packets)
    assert count > 20 and _rms(recorder, recorder.packets) > 500
    ended = await serve.wait_for_event("call_ended")
    assert ended["outcome"] == "cancelled"
    time.sleep(0.2)
    recorder.transport.close()
    assert len(recorder.packets) == count  # no RTP after the CANCEL
    await _plain_call_works(serve, tmp_path)


async def test_prack_reliable_183_is_resent_until_prack_then_answered(serve, tmp_path):
    (tmp_path / "plain").mkdir()
    recorder = await rtp_recorder()
    rc, errors = await _sipp(serve, "gw_prack.xml", tmp_path / "call", "3001", recorder)
    recorder.transport.close()
    assert rc == 0, errors
    messages = sipp_messages(tmp_path / "call")
    # T1 = 50 ms: the 183 goes at 0 and again at 50, 150 and 350 ms while the PRACK is held back 400 ms.
    assert messages.count("SIP/2.0 183 Session Progress") >= 3
    assert "PRACK sip:" in messages
    await serve.wait_for_event("sip_prack")
    assert len(recorder.packets) > 100 and _rms(recorder, recorder.packets) > 500
    _one_stream(recorder.packets)
    await _plain_call_works(serve, tmp_path)


async def test_early_media_header_selects_it_and_a_bad_value_is_refused_with_400(serve, tmp_path):
    (tmp_path / "plain").mkdir()
    status = await invite_final_response(serve.sip_address, {"X-TTS-Text": "Hello.", "X-TTS-Early-Media": "later"})
    assert status.startswith("SIP/2.0 400")
    status = await invite_final_response(serve.sip_address, {"X-TTS-Text": "Sorry.", "X-TTS-Early-Media": "reject",
                                                              "X-TTS-Reject-Code": "603"})
    assert status == "SIP/2.0 603 Decline"  # after the announcement, as the header asked
    early = await serve.wait_for_event("sip_early_media")
    assert early["reliable"] is False
    await _plain_call_works(serve, tmp_path)
