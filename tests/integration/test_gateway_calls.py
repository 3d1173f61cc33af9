"""Whole-gateway calls from real peers over loopback: SIPp callers and the pjsua2 test phone.

The gateway runs in the test's event loop with the CPU engine (eSpeak NG); a plain UDP socket plays the
caller's RTP port, so the packets the gateway sends are checked exactly as a phone would receive them.
SIPp may exit before the gateway's call session has counted its outcome: tests that read outcomes or
metrics first wait on `Gateway.calls_ended`.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics

import numpy as np
import pytest

from gateway import metrics
from integration_harness import (SCENARIOS, SIP_SCENARIOS, rtp_recorder, run_sipp, start_gateway)

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

LONG_TEXT = ("Thank you for calling the speech gateway. This prompt is long on purpose, so that the caller "
             "can put us on hold, take us off hold again, and still hear the rest of the sentence afterwards.")
CODECS = {"PCMU": "0", "PCMA": "8"}


def _outcomes() -> dict[str, float]:
    return {s.labels["outcome"]: s.value for m in metrics.calls_total.collect() for s in m.samples
            if s.name.endswith("_total")}


@pytest.fixture
async def gateway():
    gw = await start_gateway("espeak")
    yield gw
    await gw.stop()


@pytest.mark.parametrize("codec", ["PCMU", "PCMA"])
async def test_call_is_answered_spoken_as_paced_g711_and_hung_up(gateway, tmp_path, codec):
    recorder = await rtp_recorder()
    before = _outcomes().get("completed", 0)
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, tmp_path, keys={
        "text": "Hello caller, this is the speech gateway.", "rtp_rx": str(recorder.port),
        "codec_pt": CODECS[codec], "codec_name": codec})
    recorder.transport.close()
    assert await gateway.calls_ended(5)
    assert rc == 0, errors
    packets = recorder.packets
    assert len(packets) > 50  # > 1 s of audio
    assert {len(p.payload) for p in packets} == {160}
    assert {p.payload_type for p in packets} == {int(CODECS[codec])}
    assert len({p.ssrc for p in packets}) == 1
    assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    assert packets[0].marker and not any(p.marker for p in packets[1:])
    intervals = [b.at - a.at for a, b in zip(packets, packets[1:])]
    assert abs(statistics.median(intervals) - 0.020) < 0.002
    audio = recorder.audio(codec).astype(np.float64)
    assert np.sqrt(np.mean(audio**2)) > 500  # speech, far above silence (G.711 idle is ~0-8)
    assert _outcomes().get("completed", 0) == before + 1


async def test_hold_stops_rtp_and_resume_continues_sequence_and_timestamps(gateway, tmp_path):
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_hold_resume.xml", gateway.sip.udp_address, tmp_path, keys={
        "text": LONG_TEXT, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    packets = recorder.packets
    gaps = [(b.at - a.at, a, b) for a, b in zip(packets, packets[1:])]
    gap, before, after = max(gaps, key=lambda g: g[0])
    assert gap > 0.7  # on hold: nothing was sent for most of the hold time
    assert (after.seq - before.seq) % 65536 == 1  # sequence numbers stay continuous (RFC 3550 §5.1)
    elapsed_samples = (after.timestamp - before.timestamp) % 2**32
    assert abs(elapsed_samples - gap * 8000) < 0.06 * 8000  # timestamp advanced by the real time on hold
    assert after.marker  # a new talkspurt starts after the resume
    assert sum(1 for p in packets if p.marker) == 2


async def test_caller_hangs_up_mid_prompt_and_rtp_stops(gateway, tmp_path):
    recorder = await rtp_recorder()
    before = _outcomes().get("caller_hangup", 0)
    rc, errors = await run_sipp(SCENARIOS / "gw_caller_bye.xml", gateway.sip.udp_address, tmp_path, keys={
        "text": LONG_TEXT, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    count = len(recorder.packets)
    # A negative check: the session has ended and closed its RTP socket, so nothing can be sent any more;
    # the bounded wait only lets a packet already in flight (a late send would be one) reach the recorder.
    await asyncio.sleep(0.3)
    recorder.transport.close()
    assert 20 < count < 80  # spoke for about the 0.8 s before the BYE, not the whole prompt
    assert len(recorder.packets) == count  # nothing after the BYE
    assert _outcomes().get("caller_hangup", 0) == before + 1


async def test_offer_without_a_codec_we_speak_is_refused_with_488(gateway, tmp_path):
    before = _outcomes().get("rejected", 0)
    rc, errors = await run_sipp(SCENARIOS / "gw_no_common_codec.xml", gateway.sip.udp_address, tmp_path)
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    assert _outcomes().get("rejected", 0) == before + 1


async def test_lost_ack_ends_the_call_with_bye(gateway, tmp_path):
    # T1 = 50 ms: the 200 is retransmitted for 64*T1 = 3.2 s, then the gateway gives up and sends BYE
    before = _outcomes().get("ack_timeout", 0)
    rc, errors = await run_sipp(SIP_SCENARIOS / "uac_no_ack.xml", gateway.sip.udp_address, tmp_path)
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    assert _outcomes().get("ack_timeout", 0) == before + 1


async def test_retransmitted_invite_gives_one_call(gateway, tmp_path):
    before = sum(_outcomes().values())
    rc, errors = await run_sipp(SIP_SCENARIOS / "uac_invite_retransmit.xml", gateway.sip.udp_address, tmp_path)
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    assert sum(_outcomes().values()) == before + 1


async def test_options_ping_is_answered(gateway, tmp_path):
    rc, errors = await run_sipp(SIP_SCENARIOS / "uac_options.xml", gateway.sip.udp_address, tmp_path)
    assert rc == 0, errors


async def test_pjsua2_test_phone_records_speech_from_a_route(gateway, tmp_path):
    pytest.importorskip("pjsua2")
    from gateway.pjsua_phone import place_call_async

    host, port = gateway.sip.udp_address
    wav = tmp_path / "heard.wav"
    result = await place_call_async(f"sip:1000@{host}:{port}", None, wav, 20.0)
    assert result.answered and result.ended_by == "remote", result
    import wave

    with wave.open(str(wav)) as recording:
        rate = recording.getframerate()
        samples = np.frombuffer(recording.readframes(recording.getnframes()), dtype=np.int16).astype(np.float64)
    frames = samples[: len(samples) // (rate // 50) * (rate // 50)].reshape(-1, rate // 50)
    loud = np.sqrt(np.mean(frames**2, axis=1)) > 300
    assert loud.sum() > 50  # over a second of 20 ms frames clearly above silence


async def test_engine_first_chunk_latency_is_exported(gateway, tmp_path):
    before = metrics.registry.get_sample_value("tts_first_chunk_latency_seconds_count", {"engine": "espeak"}) or 0
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, tmp_path, keys={
        "text": "Metrics, please.", "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert await gateway.calls_ended(5)
    assert rc == 0, errors
    after = metrics.registry.get_sample_value("tts_first_chunk_latency_seconds_count", {"engine": "espeak"})
    assert after == before + 1
