"""A call answered by the cosyvoice2 engine (tts_core on the tiny random-weight golden model, CPU).

Random weights speak noise, not words, so this asserts what a caller's phone would check: the call is
answered, the audio arrives as well-formed, paced G.711 with real energy, and the gateway hangs up.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


@pytest.fixture
async def cosyvoice2_gateway(tiny_model_dir):
    pytest.importorskip("torch")
    gateway = await start_gateway("cosyvoice2", engine_settings={
        "model_dir": str(tiny_model_dir), "device": "cpu", "dtype": "fp32", "default_voice": "golden_speaker",
        "max_batch": 2, "seed": 7})
    yield gateway
    await gateway.stop()


async def test_cosyvoice2_engine_answers_a_sipp_call_with_paced_rtp(cosyvoice2_gateway, tmp_path):
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", cosyvoice2_gateway.sip.udp_address, tmp_path, keys={
        "text": "Hello from the neural engine.", "rtp_rx": str(recorder.port), "codec_pt": "8",
        "codec_name": "PCMA"}, timeout_s=90)
    recorder.transport.close()
    assert rc == 0, errors
    packets = recorder.packets
    assert len(packets) >= 25  # the tiny model's forced minimum length gives well over half a second
    assert {len(p.payload) for p in packets} == {160} and {p.payload_type for p in packets} == {8}
    assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    steps = [(b.timestamp - a.timestamp) % 2**32 for a, b in zip(packets, packets[1:])]
    assert all(step >= 160 and step % 160 == 0 for step in steps)  # RTP time moves in whole packets
    # One packet's time per packet, except where the packet clock skipped ticks because the process
    # stalled (a busy 2-core CI box): then by no more than it skipped (its skips count every phase).
    clock = cosyvoice2_gateway.media.clock
    assert sum(step // 160 - 1 for step in steps) <= -(-clock.skipped_ticks // clock.phases)
    audio = recorder.audio("PCMA").astype(np.float64)
    assert np.sqrt(np.mean(audio**2)) > 300  # random weights: loud noise-like audio, not silence


async def test_unknown_voice_is_refused_before_answer(cosyvoice2_gateway):
    status = await invite_final_response(cosyvoice2_gateway.sip.udp_address,
                                         {"X-TTS-Text": "hello", "X-TTS-Voice": "nobody"})
    assert status.startswith("SIP/2.0 404")
    assert "Voice" in status  # the reason phrase says why: "Unknown Voice"
