"""Wideband calls: a SIPp phone offering G.722 first is answered with G.722, and hears paced RTP of payload type 9,
160 bytes and 160 timestamp units per 20 ms packet (RFC 3551 §4.5.2), carrying 16 kHz speech with energy above
the 4 kHz that G.711 could carry."""

from __future__ import annotations

import shutil
import statistics

import numpy as np
import pytest

from integration_harness import SCENARIOS, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


def band_share(audio: np.ndarray, rate: int, low_hz: float, high_hz: float) -> float:
    spectrum = np.abs(np.fft.rfft(audio.astype(np.float64))) ** 2
    freqs = np.fft.rfftfreq(audio.size, 1 / rate)
    return float(spectrum[(freqs >= low_hz) & (freqs < high_hz)].sum() / spectrum.sum())


async def test_g722_offer_is_answered_with_g722_and_heard_wideband(tmp_path):
    gateway = await start_gateway("espeak")
    try:
        recorder = await rtp_recorder()
        rc, errors = await run_sipp(SCENARIOS / "gw_listen_g722.xml", gateway.sip.udp_address, tmp_path, keys={
            "text": "Thank you for calling. Six sixty six, sister Susan sells sea shells.",
            "rtp_rx": str(recorder.port)})
        recorder.transport.close()
        assert rc == 0, errors  # the scenario checks the answer: m=audio ... RTP/AVP 9, a=rtpmap:9 G722/8000
        assert await gateway.calls_ended(5)
    finally:
        await gateway.stop()
    packets = recorder.packets
    assert len(packets) > 100
    assert {p.payload_type for p in packets} == {9}
    assert {len(p.payload) for p in packets} == {160}  # 320 samples of 16 kHz audio at 4 bits each
    assert all((b.timestamp - a.timestamp) % 2**32 == 160 for a, b in zip(packets, packets[1:]))
    assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:]))
    assert abs(statistics.median(b.at - a.at for a, b in zip(packets, packets[1:])) - 0.020) < 0.002
    audio = recorder.audio("G722")
    assert audio.size == 320 * len(packets)
    assert np.sqrt(np.mean(audio.astype(np.float64) ** 2)) > 500  # speech
    assert band_share(audio, 16000, 4000, 7500) > 0.005  # the fricatives' band: absent from 8 kHz audio


async def test_a_cached_prompt_is_kept_per_line_rate_and_a_g722_hit_is_still_wideband(tmp_path):
    """The prompt cache's key holds the line rate: a G.722 call's 16 kHz entry is a hit for the next G.722 call
    (no engine stream, still wideband), and a G.711 call of the same text is a miss (an 8 kHz entry of its own)."""
    text = "Thank you for calling. Six sixty six, sister Susan sells sea shells."
    gateway = await start_gateway("espeak")
    try:
        opened, heard = [], []
        pcmu = {"codec_pt": "0", "codec_name": "PCMU"}
        for scenario, keys in [("gw_listen_g722_cached.xml", {})] * 3 + [("gw_listen_cached.xml", pcmu)]:
            recorder = await rtp_recorder()
            rc, errors = await run_sipp(SCENARIOS / scenario, gateway.sip.udp_address, tmp_path,
                                        keys={"text": text, "rtp_rx": str(recorder.port), **keys})
            recorder.transport.close()
            assert rc == 0, errors
            assert await gateway.calls_ended(5)
            opened.append(gateway.engine.streams_opened)
            heard.append(recorder)
    finally:
        await gateway.stop()
    # call 1 measures the voice's level (uncached), call 2 fills the 16 kHz entry, call 3 hits, the PCMU call misses
    assert opened[2] == opened[1] and opened[3] == opened[2] + 1
    assert {p.payload_type for p in heard[2].packets} == {9} and {p.payload_type for p in heard[3].packets} == {0}
    audio = heard[2].audio("G722")
    assert np.sqrt(np.mean(audio.astype(np.float64) ** 2)) > 500
    assert band_share(audio, 16000, 4000, 7500) > 0.005


def wav_samples(path) -> tuple[int, np.ndarray]:
    import wave

    with wave.open(str(path)) as recording:
        return recording.getframerate(), np.frombuffer(recording.readframes(recording.getnframes()), dtype=np.int16)


async def test_pjsua2_test_phone_records_a_g722_call_at_16khz_with_the_wideband_band(tmp_path):
    """The test phone (`cosyvoice-gateway call --codec g722 --record heard.wav`): its WAV is 16 kHz and, unlike
    the same prompt over G.711, holds the 4-7.5 kHz band."""
    pytest.importorskip("pjsua2")
    from gateway.pjsua_phone import place_call_async

    gateway = await start_gateway("espeak")
    text = "Six sixty six, sister Susan sells sea shells, said the speech gateway."
    try:
        host, port = gateway.sip.udp_address
        heard = {}
        for codecs in (("G722",), ("PCMU",)):
            wav = tmp_path / f"{codecs[0]}.wav"
            result = await place_call_async(f"sip:1000@{host}:{port}", text, wav, 20.0, codecs=codecs)
            assert result.answered and result.ended_by == "remote" and result.codec == codecs[0], result
            heard[codecs[0]] = wav_samples(wav)
    finally:
        await gateway.stop()
    rate, wide = heard["G722"]
    assert rate == 16000
    assert np.sqrt(np.mean(wide.astype(np.float64) ** 2)) > 300
    _, narrow = heard["PCMU"]
    assert band_share(wide, 16000, 4000, 7500) > 0.005
    assert band_share(narrow, 16000, 4000, 7500) < band_share(wide, 16000, 4000, 7500) / 10
