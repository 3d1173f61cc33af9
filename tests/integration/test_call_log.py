"""What one call leaves in `serve`'s log (issue #33 item 6): each event once, not once per layer. The SIP
server logs the INVITE (`sip_invite`), the call layer the answer or refusal and the end, with the dialog's
own end reason in the same line (`call_ended`: outcome and sip_end)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from integration_harness import invite_final_response, rtp_recorder, run_sipp
from serve_process import start_serve

pytestmark = [pytest.mark.timeout(90)]
SCENARIOS = Path(__file__).resolve().parent / "sipp"


async def test_an_answered_and_a_refused_call_log_each_event_once(tmp_path):
    gateway = await start_serve(tmp_path, None, "media.rtp_port_range=45100-45199", engine="espeak")
    try:
        await gateway.wait_healthy()
        recorder = await rtp_recorder()
        rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip_address, tmp_path, keys={
            "text": "Once is enough.", "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
        recorder.transport.close()
        assert rc == 0, errors
        assert await invite_final_response(gateway.sip_address, {"X-TTS-Text": "hi", "X-TTS-Voice": "klingon"}
                                           ) == "SIP/2.0 404 Unknown Voice"
        ended = [await gateway.wait_for_event("call_ended") for _ in range(2)]
    finally:
        assert await gateway.stop() == 0
    by_call: dict[str, Counter] = {}
    for event in gateway.log_events():
        if "call_id" in event:
            by_call.setdefault(event["call_id"], Counter())[event["event"]] += 1
    assert len(by_call) == 2
    for call_id, events in by_call.items():
        assert [name for name, count in events.items() if count > 1] == [], (call_id, events)
        assert events["sip_invite"] == events["call_ended"] == 1
        assert not {"invite", "sip_call_answered", "sip_call_rejected", "sip_call_ended"} & set(events)
    answered, refused = sorted(by_call.values(), key=lambda events: "answered" not in events)
    assert answered["answered"] == 1 and "rejected" not in answered
    assert refused["rejected"] == 1 and "answered" not in refused
    assert sorted((e["outcome"], e["sip_end"]) for e in ended) == [("completed", "local_bye"),
                                                                   ("rejected", "rejected")]
