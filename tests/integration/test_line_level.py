"""The level a caller hears: SIPp calls over loopback, the RTP decoded as the caller's phone would."""

from __future__ import annotations

import asyncio
import shutil

import numpy as np
import pytest

from integration_harness import SCENARIOS, rtp_recorder, run_sipp, start_gateway
from speech_audio import g711
from speech_audio.level import active_speech_dbm0, peak_of_dbm0

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


async def _heard(gateway, workdir, text: str, codec: str = "PCMU") -> np.ndarray:
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, workdir, keys={
        "text": text, "rtp_rx": str(recorder.port), "codec_pt": {"PCMU": "0", "PCMA": "8"}[codec],
        "codec_name": codec})
    recorder.transport.close()
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    return recorder.audio(codec)


@pytest.mark.parametrize(("target", "codec"), [(-19.0, "PCMU"), (-26.0, "PCMA")])
async def test_a_heard_call_is_at_the_configured_active_speech_level(tmp_path, target, codec):
    gateway = await start_gateway("espeak", extra={"media.speech_level_dbm0": target})
    try:
        await gateway.speech.gain_db("en")  # as at start for a prerendered prompt's voice
        # not the text the level was measured on (speech_audio/voice_gain.py): the voice's one gain holds for what
        # it says, to within the engine's own spread between texts
        for text in ("Your balance is one hundred and twenty three dollars and forty cents.",
                     "Thank you for calling the speech gateway. Your call is important to us, please stay on the line."):
            heard = await _heard(gateway, tmp_path, text, codec)
            assert abs(active_speech_dbm0(heard, 8000) - target) < 1.0
        assert gateway.engine.streams_opened == 3  # the voice's level was measured once, then the two prompts
        assert gateway.speech.gains.measured.keys() == {("en", gateway.engine.model_identity("en"))}
    finally:
        await gateway.stop()


async def test_a_level_of_null_leaves_the_engine_level(tmp_path):
    text = "Your balance is one hundred and twenty three dollars and forty cents."
    gateway = await start_gateway("espeak", extra={"media.speech_level_dbm0": None})
    try:
        heard = await _heard(gateway, tmp_path, text)
        assert gateway.engine.streams_opened == 1  # nothing to measure
        assert abs(active_speech_dbm0(heard, 8000) - (-19.0)) > 2.0  # espeak speaks louder than the target
    finally:
        await gateway.stop()


async def test_a_loud_engine_turned_up_never_passes_the_limiter_ceiling(tmp_path):
    """The instant engine's test signal (peaks near -3 dBm0 at -10 dBm0 active) brought to -6 dBm0 active: its peaks
    would reach about +1 dBm0; the caller hears none above the ceiling (the 0 dBm0 sine's peak, as G.711 codes it)."""
    gateway = await start_gateway("instant", extra={"media.speech_level_dbm0": -6.0})
    try:
        await gateway.speech.gain_db("en")
        heard = await _heard(gateway, tmp_path, "A loud prompt that would clip without the limiter on the line.")
        ceiling = int(peak_of_dbm0(0.0) * 32768)
        coded_ceiling = int(g711.decode(g711.encode(np.array([ceiling], np.int16), "PCMU"), "PCMU")[0])
        assert np.max(np.abs(heard.astype(np.int32))) <= coded_ceiling
        assert np.max(np.abs(heard.astype(np.int32))) >= 0.9 * ceiling  # the limiter held the peaks, not a gain drop
        assert abs(active_speech_dbm0(heard, 8000) - (-6.0)) < 1.0
    finally:
        await gateway.stop()


async def test_a_voice_never_measured_is_measured_on_its_first_call_which_plays_at_the_engine_level(tmp_path):
    gateway = await start_gateway("espeak", extra={"media.speech_level_dbm0": -19.0})
    try:
        text = "Your balance is one hundred and twenty three dollars and forty cents."
        first = await _heard(gateway, tmp_path, text)  # answered at once, at espeak's own level (about -13)
        assert active_speech_dbm0(first, 8000) > -16.0
        for _ in range(100):
            if gateway.speech.gains.known("en", gateway.engine.model_identity("en"))[0]:
                break
            await asyncio.sleep(0.05)  # waiting for the background measurement, not pacing media
        second = await _heard(gateway, tmp_path, text)
        assert abs(active_speech_dbm0(second, 8000) - (-19.0)) < 1.0
    finally:
        await gateway.stop()
