"""CosyVoice3 end to end, as operators run it: `cosyvoice-gateway serve` with a supervised engine worker on the tiny
random-weight CosyVoice3 model (CPU; the family read from the directory), real SIPp callers and RTP sockets on
loopback. A call with X-TTS-Text is answered with audible, paced audio and hung up; a routed call whose route names
a dialect is spoken too (the dialect travels to the worker as a request option, never as text); a dialect on a
call is refused 400 when the name is not on the model's list.

Random weights speak noise, not words: this asserts what a caller's phone would check.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp
from supervised_serve import listening_call, speech_level, start_serve, stop_serve

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


async def test_a_cosyvoice3_worker_speaks_a_call_and_a_dialect_route(tmp_path, tiny3_model_dir):
    pytest.importorskip("torch")
    serve = await start_serve(tmp_path, {"name": "cosyvoice2", "workers": 1, "cosyvoice2": {
        "model_dir": str(tiny3_model_dir), "device": "cpu", "dtype": "fp32", "default_voice": "golden_speaker",
        "max_batch": 2, "seed": 7, "warmup": False}},
        extra={"routes": [{"match": "2000", "text": "您好，欢迎致电。", "dialect": "cantonese", "cache": False}]})
    try:
        await serve.until_healthy(timeout=120)
        call, recorder = await listening_call(serve, tmp_path, "Hello from CosyVoice3.", "call")
        rc, errors, _ = await asyncio.wait_for(call, 120)
        recorder.transport.close()
        assert rc == 0, errors
        assert len(recorder.packets) > 25 and speech_level(recorder) > 300

        routed = await rtp_recorder()
        workdir = tmp_path / "routed"
        workdir.mkdir()
        rc, errors = await run_sipp(SCENARIOS / "gw_route_listen.xml", serve.sip, workdir, service="2000",
                                    keys={"rtp_rx": str(routed.port), "codec_pt": "0", "codec_name": "PCMU"},
                                    timeout_s=120)
        routed.transport.close()
        assert rc == 0, errors
        assert len(routed.packets) > 25 and speech_level(routed) > 300

        status = await invite_final_response(serve.sip, {"X-TTS-Text": "hello", "X-TTS-Dialect": "klingon"})
        assert status.startswith("SIP/2.0 400"), status
        started = [e for e in serve.log_events("cosyvoice2_engine_started")]
        assert started and started[-1]["family"] == 3
    finally:
        await stop_serve(serve)
    assert serve.process.returncode == 0
