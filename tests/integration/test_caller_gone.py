"""A caller that vanishes without BYE does not hold its slot: no RTP/RTCP for media.inactivity_timeout_s
ends the call with our BYE (outcome media_timeout); RTP from the caller keeps it up. A call on hold (where
the caller may send nothing, RFC 3264 §5.1) is measured against the longer media.hold_timeout_s instead:
not ended within the inactivity timeout, ended with outcome hold_timeout after the hold timeout."""

from __future__ import annotations

import asyncio
import shutil
import struct
import time

import pytest

from gateway import metrics
from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(60),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

TIMEOUT_S = 1.0


def _outcome(name: str) -> float:
    return metrics.registry.get_sample_value("gateway_calls_total", {"outcome": name}) or 0.0


async def _gateway(**media):
    return await start_gateway("instant", engine_settings={"ms_per_char": 60},
                               extra={"media.inactivity_timeout_s": TIMEOUT_S,
                                      **{f"media.{key}": value for key, value in media.items()}})


async def _sipp(scenario: str, gateway, recorder, tmp_path) -> tuple[int, str]:
    """One SIPp call of `scenario` asking for "hello" and then to stay, its media port the recorder's."""
    return await run_sipp(SCENARIOS / scenario, gateway.sip.udp_address, tmp_path, keys={
        "text": "hello", "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})


async def _first_packet(recorder) -> tuple[str, int]:
    await recorder.wait_for_packets(1)
    return recorder.sources[0]


async def test_a_stay_call_whose_caller_sends_nothing_is_ended_with_bye(tmp_path):
    gateway = await _gateway()
    try:
        timeouts0 = _outcome("media_timeout")
        recorder = await rtp_recorder()
        rc, errors = await _sipp("gw_stay.xml", gateway, recorder, tmp_path)
        assert rc == 0, errors  # the gateway's BYE arrived (gw_stay never hangs up itself)
        assert await gateway.calls_ended(5)
        assert _outcome("media_timeout") == timeouts0 + 1
        assert gateway.status()["calls_active"] == 0
    finally:
        await gateway.stop()


async def test_rtp_from_the_caller_keeps_the_call_up(tmp_path):
    gateway = await _gateway()
    try:
        timeouts0 = _outcome("media_timeout")
        recorder = await rtp_recorder()
        call = asyncio.create_task(_sipp("gw_stay.xml", gateway, recorder, tmp_path))
        gateway_rtp = await _first_packet(recorder)
        talking_until = time.monotonic() + 3 * TIMEOUT_S
        seq = 0
        while time.monotonic() < talking_until:  # the caller talks: one PCMU packet per 200 ms
            recorder.transport.sendto(struct.pack("!BBHII", 0x80, 0, seq, seq * 160, 0x1234) + b"\xff" * 160,
                                      gateway_rtp)
            seq += 1
            await asyncio.sleep(0.2)
            assert not call.done(), "the call ended while the caller was sending RTP"
        rc, errors = await call  # the caller stopped sending: now it is ended
        assert rc == 0, errors
        assert await gateway.calls_ended(5)
        assert _outcome("media_timeout") == timeouts0 + 1
    finally:
        await gateway.stop()


async def test_a_call_on_hold_is_not_ended_for_the_inactivity_timeout(tmp_path):
    gateway = await _gateway()
    try:
        timeouts0, hangups0 = _outcome("media_timeout"), _outcome("caller_hangup")
        recorder = await rtp_recorder()
        # a=inactive after 0.5 s, then 3 s (three timeouts) of silence; a BYE from us would fail the scenario
        rc, errors = await _sipp("gw_hold_silent.xml", gateway, recorder, tmp_path)
        assert rc == 0, errors
        assert await gateway.calls_ended(5)  # SIPp may exit before the session has counted its outcome
        assert _outcome("caller_hangup") == hangups0 + 1
        assert _outcome("media_timeout") == timeouts0
    finally:
        await gateway.stop()


async def test_a_held_caller_who_vanishes_is_ended_after_the_hold_timeout(tmp_path):
    """50 held callers who vanished used to fill max_calls for good: the inactivity timer is suspended on hold."""
    gateway = await _gateway(inactivity_timeout_s=30, hold_timeout_s=TIMEOUT_S)
    try:
        held0, timeouts0 = _outcome("hold_timeout"), _outcome("media_timeout")
        recorder = await rtp_recorder()
        # re-INVITE a=sendonly after 0.5 s (answered a=recvonly), then silence until the gateway's BYE
        rc, errors = await _sipp("gw_hold_vanish.xml", gateway, recorder, tmp_path)
        assert rc == 0, errors
        assert await gateway.calls_ended(5)
        assert (_outcome("hold_timeout"), _outcome("media_timeout")) == (held0 + 1, timeouts0)
        assert gateway.status()["calls_active"] == 0 and gateway.sip.active_calls == 0
        status = await invite_final_response(gateway.sip.udp_address, {"X-TTS-Text": "hi"})
        assert status.startswith("SIP/2.0 200")  # a normal call works afterwards
    finally:
        await gateway.stop()
