"""The PBX examples in sip_config/asterisk/ and sip_config/freeswitch/, as the gateway meets them: a real
`serve` (instant engine) answers the INVITE each example makes (tests/sipp/uac_asterisk_pjsip.xml,
uac_freeswitch_sofia.xml: the headers and SDP that Asterisk's chan_pjsip and FreeSWITCH's mod_sofia put on
it), speaks the text the example sets, RTP arrives, and the gateway hangs up. The Asterisk INVITE also goes
through Kamailio in front (sip_config/kamailio/), which must pass the header on untouched.

What was spoken is checked in the audio itself: the instant engine's signal is a function of the text
(its pitch is seeded by the text's CRC-32, its length follows the text's length), so the audio the caller
received matches the signal of the decoded header text, and not that of the text as it was sent. FreeSWITCH
offers G.722 ahead of G.711 (and the gateway answers with it), Asterisk PCMU first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import soxr

from engines.base import SAMPLE_RATE
from engines.instant import render_test_signal, signal_seconds
from integration_harness import SIP_SCENARIOS, rtp_recorder, run_sipp
from serve_process import start_serve
from test_kamailio_failover import KAMAILIO, _options_answered, _start_kamailio, _until

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

ROOT = Path(__file__).resolve().parents[2]
# The texts the examples set (sip_config/asterisk/extensions.conf, sip_config/freeswitch/dialplan.xml).
EXAMPLES = {
    "asterisk": ("uac_asterisk_pjsip.xml", "Your appointment is confirmed for Tuesday at 10:30. 谢谢!",
                 "Your%20appointment%20is%20confirmed%20for%20Tuesday%20at%2010%3A30.%20%E8%B0%A2%E8%B0%A2!"),
    "freeswitch": ("uac_freeswitch_sofia.xml", "Hello from FreeSWITCH. 你好!", None),
}
# The first codec of each example's offer that the gateway speaks: (payload type, name, audio rate).
CODEC = {"asterisk": (0, "PCMU", 8000), "freeswitch": (9, "G722", 16000)}
SETTINGS = ("trunks=[{name: pbx, allow: [127.0.0.0/8]}]", "voices={english: en}", "media.rtp_port_range=45000-45999")


def instant_signal(text: str, rate: int) -> np.ndarray:
    """What the instant engine (default settings) renders for `text`, at the call's rate."""
    total = round(signal_seconds(text, 60.0, 0.5, 30.0) * SAMPLE_RATE)
    return soxr.resample(render_test_signal(text, 0, total), SAMPLE_RATE, rate)


def best_match(heard: np.ndarray, expected: np.ndarray) -> float:
    """The highest normalised correlation of `expected` against any stretch of `heard`."""
    heard = heard.astype(np.float64)
    expected = expected.astype(np.float64)
    window = len(expected)
    if len(heard) < window:
        return 0.0
    dots = np.correlate(heard, expected, mode="valid")
    energy = np.sqrt(np.convolve(heard ** 2, np.ones(window), mode="valid"))
    return float(np.max(dots / (energy * np.linalg.norm(expected) + 1e-12)))


def test_the_examples_name_the_text_the_scenarios_send():
    asterisk = (ROOT / "sip_config" / "asterisk" / "extensions.conf").read_text()
    freeswitch = (ROOT / "sip_config" / "freeswitch" / "dialplan.xml").read_text()
    assert f"Set(_TTS_TEXT={EXAMPLES['asterisk'][1]})" in asterisk
    assert f'data="tts_text={EXAMPLES["freeswitch"][1]}"' in freeswitch
    for scenario, text, sent in EXAMPLES.values():
        assert f"X-TTS-Text: {sent or text}\n" in (SIP_SCENARIOS / scenario).read_text()


@pytest.mark.parametrize("pbx", [*sorted(EXAMPLES), "asterisk via kamailio"])
async def test_the_gateway_speaks_the_text_the_pbx_example_sends(pbx, tmp_path):
    scenario, text, sent = EXAMPLES[pbx.split()[0]]
    gateway = await start_serve(tmp_path, None, *SETTINGS, engine="instant")
    kamailio = None
    try:
        await gateway.wait_healthy(timeout_s=60)
        target = gateway.sip_address
        if pbx.endswith("kamailio"):
            if KAMAILIO is None:
                pytest.skip("kamailio not installed (apt-get install kamailio)")
            kamailio, port = await _start_kamailio(tmp_path, [gateway])
            target = ("127.0.0.1", port)
            await _until(lambda: _options_answered(target), "kamailio to listen")
        recorder = await rtp_recorder()
        rc, errors = await run_sipp(SIP_SCENARIOS / scenario, target, tmp_path, service="tts",
                                    keys={"rtp_rx": str(recorder.port)}, timeout_s=60)
        recorder.transport.close()
        assert rc == 0, errors  # answered (200), and after the prompt the gateway hung up with BYE
        assert recorder.packets, "no RTP reached the PBX's media port"
        payload_type, codec, rate = CODEC[pbx.split()[0]]
        assert {p.payload_type for p in recorder.packets} == {payload_type}, f"{codec}, the first codec both have"
        heard = recorder.audio(codec)
        expected = instant_signal(text, rate)
        heard = np.concatenate([heard, np.zeros(rate // 50, dtype=heard.dtype)])  # G.722's QMF filters delay ~1.5 ms
        assert best_match(heard, expected) > 0.9, "the caller did not hear the decoded header text"
        if sent is not None:  # the percent-encoded form was decoded, not spoken as sent
            assert best_match(heard, instant_signal(sent, rate)[:len(expected)]) < 0.5
        assert len(heard) < len(expected) + rate * 2 + rate // 50  # that text and nothing long after it
    finally:
        if kamailio is not None:
            kamailio.terminate()
            await kamailio.wait()
        assert await gateway.stop() == 0, gateway.tail()
