"""SSML on real calls: a SIPp caller sends an SSML X-TTS-Text, the gateway (eSpeak NG) speaks it, and the RTP the
caller's socket receives carries the `<break>` as silence of that length; a document that cannot be spoken is
refused with 400 before any answer, its parse error in the Warning header."""

from __future__ import annotations

import asyncio
import re
import shutil
from urllib.parse import quote

import numpy as np
import pytest

from integration_harness import SCENARIOS, invite_final_reply, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


@pytest.fixture
async def gateway():
    gw = await start_gateway("espeak")
    yield gw
    await gw.stop()


def longest_silence_s(audio: np.ndarray, rate: int = 8000) -> float:
    """The longest run of 10 ms frames with no sound (peak below -60 dBFS) between the first and last sound."""
    frames = audio[: len(audio) // 80 * 80].reshape(-1, 80)
    loud = np.flatnonzero(np.abs(frames).max(axis=1) > 32)
    if len(loud) < 2:
        return 0.0
    return float(np.diff(loud).max() - 1) * 80 / rate


async def heard(gateway, workdir, document: str, voice: str) -> np.ndarray:
    workdir.mkdir()
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen_voice.xml", gateway.sip.udp_address, workdir, keys={
        "text": quote(document), "voice": voice, "rtp_rx": str(recorder.port)})
    recorder.transport.close()
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    return recorder.audio("PCMU").astype(np.float64)


@pytest.mark.parametrize(("voice", "document", "pause_s"), [
    ("en", '<speak>Your balance is <say-as interpret-as="currency">$12.50</say-as>.<break time="1500ms"/>'
           'Goodbye.</speak>', 1.5),
    ("zh", '<speak>余额<say-as interpret-as="cardinal">1234</say-as>元<break time="1s"/>谢谢</speak>', 1.0),
])
async def test_break_is_heard_as_silence_of_its_length(gateway, tmp_path, voice, document, pause_s):
    audio = await heard(gateway, tmp_path / "ssml", document, voice)
    assert np.sqrt(np.mean(audio**2)) > 300  # speech was heard around the pause
    silence = longest_silence_s(audio)
    # eSpeak ends and starts each piece with a little silence of its own: at most a few hundred ms more
    assert pause_s <= silence <= pause_s + 0.5, silence
    without = await heard(gateway, tmp_path / "plain", re.sub(r"<break[^>]*>", " ", document), voice)
    assert longest_silence_s(without) < pause_s - 0.5  # the silence is the break's, not the voice's


@pytest.mark.parametrize(("headers", "warning"), [
    ({"X-TTS-Text": quote("<speak>Press <break time='300ms'>one</speak>")}, "not well-formed"),
    ({"X-TTS-Text": "Press one", "X-TTS-Type": "ssml"}, "not well-formed"),
    ({"X-TTS-Text": quote('<speak><say-as interpret-as="date" format="mdy">2024</say-as></speak>')},
     "does not match format"),
    ({"X-TTS-Text": quote('<!DOCTYPE speak [<!ENTITY a "aaaa">]><speak>&a;</speak>'), "X-TTS-Type": "ssml"},
     "no DOCTYPE or entities"),
    ({"X-TTS-Text": "hi", "X-TTS-Type": "html"}, "expected text or ssml"),
])
async def test_ssml_that_cannot_be_spoken_is_refused_400_with_the_reason(gateway, headers, warning):
    reply = await invite_final_reply(gateway.sip.udp_address, headers)
    assert reply.startswith("SIP/2.0 400 Bad SSML"), reply.split("\r\n", 1)[0]
    warning_line = next(line for line in reply.split("\r\n") if line.lower().startswith("warning:"))
    assert warning in warning_line


async def test_through_an_engine_worker_the_break_is_heard_too(tmp_path):
    """`serve` with a supervised eSpeak NG worker: the segments travel in the protocol's open frame."""
    from supervised_serve import listening_call, start_serve, stop_serve

    serve = await start_serve(tmp_path, {"name": "espeak", "workers": 1})
    try:
        await serve.until_healthy(timeout=120)
        call, recorder = await listening_call(
            serve, tmp_path, quote('<speak>Hello from a worker.<break time="1200ms"/>Goodbye.</speak>'), "call")
        rc, errors, _ = await asyncio.wait_for(call, 90)
        recorder.transport.close()
        assert rc == 0, errors
    finally:
        await stop_serve(serve)
    silence = longest_silence_s(recorder.audio("PCMU").astype(np.float64))
    assert 1.2 <= silence <= 1.7, silence
