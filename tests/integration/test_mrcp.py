"""The MRCPv2 synthesizer against a real `serve` (espeak): UniMRCP's own client (umc) and a raw-socket client
(SIP INVITE over UDP, the control connection over TCP, an RTP socket that records what arrives)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mrcp_peer import Control, Session, invite, open_session, run_umc, umc_problem, umc_workdir
from integration_harness import rtp_recorder
from speech_audio import g711
from speech_audio.level import active_speech_dbm0
from serve_process import free_port, start_serve

pytestmark = [pytest.mark.timeout(120)]

LONG_TEXT = ("This sentence is long on purpose, so that the synthesizer is still speaking it when the client "
             "asks it to stop, to pause, or when the caller barges in over it. ") * 2
PACKET_S = 0.020


@contextlib.asynccontextmanager
async def serving(tmp_path, *settings: str):
    serve = await start_serve(tmp_path, None, "mrcp.enabled=true", f"mrcp.listen=127.0.0.1:{free_port(1)}",
                              "media.rtp_port_range=43000-43999", "shutdown.drain_timeout_s=1", *settings,
                              engine="espeak")
    try:
        await serve.wait_healthy()
        yield serve
    finally:
        assert await serve.stop() == 0, serve.tail()


async def speak(session: Session, request_id: int, text: str, headers: dict[str, str] | None = None,
                content_type: str = "text/plain") -> None:
    session.control.send("SPEAK", request_id, session.channel, headers, text.encode(), content_type)


async def no_message_within(control: Control, seconds: float) -> bool:
    try:
        await control.read(timeout=seconds)
    except TimeoutError:
        return True
    return False


def rms(samples: np.ndarray) -> float:
    return float(np.sqrt(np.mean(samples.astype(np.float64) ** 2))) if samples.size else 0.0


# -- UniMRCP's client ------------------------------------------------------------------------------------
@pytest.mark.skipif(umc_problem() is not None, reason=umc_problem() or "")
async def test_umc_hears_a_speak_and_two_sessions_share_one_connection(tmp_path):
    async with serving(tmp_path) as serve:
        workdir = umc_workdir(tmp_path / "umc", serve.sip_port)
        # The second session, started while the first is up, offers a=connection:existing (UniMRCP's default).
        output = await run_umc(workdir, ["run synth", "run synth"], seconds=6)
    assert output.count("SPEAK-COMPLETE 1 COMPLETE") == 2, output[-4000:]
    assert output.count("Completion-Cause: 000 normal") == 2
    assert "a=connection:existing" in output
    assert output.count("Established TCP/MRCPv2 Connection") == 1  # both channels on one control connection
    recordings = sorted((workdir / "var").glob("synth-8kHz-*.pcm"))
    assert len(recordings) == 2
    for path in recordings:
        pcm = np.frombuffer(path.read_bytes(), dtype="<i2")
        seconds = pcm.size / 8000
        # "Welcome to Uni MRCP." (SSML): about 1.5 s from eSpeak NG; umc records 10 ms frames
        assert 0.8 < seconds < 4.0, seconds
        assert path.stat().st_size % 160 == 0
        assert rms(pcm) > 500, rms(pcm)  # speech, not silence
        frames = pcm[: pcm.size // 80 * 80].reshape(-1, 80)
        assert (np.abs(frames).max(axis=1) > 1000).mean() > 0.3  # speech throughout, not one click


@pytest.mark.skipif(umc_problem() is not None, reason=umc_problem() or "")
async def test_umc_text_plain_speak(tmp_path):
    async with serving(tmp_path) as serve:
        workdir = umc_workdir(tmp_path / "umc", serve.sip_port)
        scenario = workdir / "conf" / "umc-scenarios" / "synthesizer.xml"
        ssml = '<speak enable="1" content-type="application/synthesis+ssml" content-location="speak.xml"/>'
        plain = '<speak enable="1" content-type="text/plain" content-location="speak.txt"/>'
        scenario.write_text(scenario.read_text().replace(ssml, plain))
        output = await run_umc(workdir, ["run synth"], seconds=4)
    assert "Content-Type: text/plain" in output
    assert "Completion-Cause: 000 normal" in output, output[-4000:]
    (recording,) = (workdir / "var").glob("synth-8kHz-*.pcm")
    assert rms(np.frombuffer(recording.read_bytes(), dtype="<i2")) > 500


# -- raw-socket client -------------------------------------------------------------------------------------
def assert_framed(session: Session) -> None:
    """Every packet is 20 ms of G.711 (160 bytes) with its timestamp on the 160-sample grid."""
    packets = session.rtp.packets
    assert packets
    assert {len(p.payload) for p in packets} == {160}
    assert all((b.timestamp - a.timestamp) % 160 == 0 for a, b in zip(packets, packets[1:]))


async def test_stop_and_barge_in_end_the_audio_with_the_response(tmp_path):
    async with serving(tmp_path) as serve:
        session = await open_session(serve.sip_address)
        for request_id, method in ((1, "STOP"), (3, "BARGE-IN-OCCURRED")):
            await speak(session, request_id, LONG_TEXT)
            started = await session.control.read()
            assert (started.status, started.state) == (200, "IN-PROGRESS")
            heard = len(session.rtp.packets)
            await session.rtp.wait_for_packets(heard + 25)  # half a second of speech
            session.control.send(method, request_id + 1, session.channel)
            stopped = await session.control.read()
            assert (stopped.request_id, stopped.status, stopped.state) == (request_id + 1, 200, "COMPLETE")
            assert stopped.headers["Active-Request-Id-List"] == str(request_id)
            await asyncio.sleep(0.3)
            late = [p for p in session.rtp.packets if p.at > stopped.at + PACKET_S]
            assert late == [], f"{len(late)} packets after the {method} response"
            assert await no_message_within(session.control, 0.2)  # no SPEAK-COMPLETE for a stopped SPEAK (§8.8)
        assert_framed(session)
        # the channel still speaks after both
        await speak(session, 5, "Still here.")
        assert (await session.control.read()).state == "IN-PROGRESS"
        done = await session.control.read()
        assert (done.event, done.request_id, done.headers["Completion-Cause"]) == ("SPEAK-COMPLETE", 5, "000 normal")
        await session.close()


async def test_pause_resume_and_queued_speaks_complete_in_order(tmp_path):
    async with serving(tmp_path) as serve:
        session = await open_session(serve.sip_address)
        control = session.control
        session.control.send("PAUSE", 1, session.channel)
        assert (await control.read()).status == 402  # nothing to pause yet
        await speak(session, 2, LONG_TEXT[:150])
        await speak(session, 3, "And a second sentence, queued behind the first.")
        # responses name their request; the queued one may be answered before the first's engine stream is in
        first, second = sorted([await control.read(), await control.read()], key=lambda m: m.request_id)
        assert (first.request_id, first.status, first.state) == (2, 200, "IN-PROGRESS")
        assert (second.request_id, second.status, second.state) == (3, 200, "PENDING")
        await session.rtp.wait_for_packets(20)
        control.send("PAUSE", 4, session.channel)
        paused = await control.read()
        assert (paused.status, paused.headers["Active-Request-Id-List"]) == (200, "2")
        await asyncio.sleep(0.5)
        assert [p for p in session.rtp.packets if p.at > paused.at + PACKET_S] == []
        held = len(session.rtp.packets)
        control.send("RESUME", 5, session.channel)
        assert (await control.read()).status == 200
        await session.rtp.wait_for_packets(held + 10)
        events = [await control.read(timeout=30) for _ in range(3)]
        assert [(e.event, e.request_id, e.state) for e in events] == [
            ("SPEAK-COMPLETE", 2, "COMPLETE"), ("SPEECH-MARKER", 3, "IN-PROGRESS"), ("SPEAK-COMPLETE", 3, "COMPLETE")]
        assert events[0].headers["Completion-Cause"] == events[2].headers["Completion-Cause"] == "000 normal"
        assert_framed(session)
        speech = session.rtp.audio("PCMU")
        assert rms(speech) > 0.03
        assert speech.size / 8000 > 3.0  # both sentences were heard, the first in full after its pause
        await session.close()


async def test_speak_audio_leaves_at_the_configured_line_level_as_a_calls_does(tmp_path):
    """media.speech_level_dbm0 holds for MRCP as for SIP calls: the voice's first SPEAK is heard at the engine's level
    and measures the voice (speech_audio/voice_gain.py); every later SPEAK of it is at the configured level."""
    target = -26.0  # espeak speaks near -13 dBm0: far from this
    async with serving(tmp_path, f"media.speech_level_dbm0={target}") as serve:
        session = await open_session(serve.sip_address)
        levels = []
        for request_id, text in enumerate(("Your balance is one hundred and twenty three dollars and forty cents.",
                                           "Thank you for calling. Your call is important to us, please stay on "
                                           "the line."), start=1):
            start = len(session.rtp.packets)
            await speak(session, request_id, text)
            assert (await session.control.read()).state == "IN-PROGRESS"
            done = await session.control.read(timeout=30)
            assert (done.event, done.headers["Completion-Cause"]) == ("SPEAK-COMPLETE", "000 normal")
            await asyncio.sleep(0.2)  # the playout's last packets
            heard = g711.decode(b"".join(p.payload for p in session.rtp.packets[start:]), "PCMU")
            levels.append(active_speech_dbm0(heard, 8000))
        assert levels[0] > target + 5.0  # the first, at espeak's own level, measured the voice
        assert abs(levels[1] - target) < 1.0, levels
        await session.close()


async def test_params_switch_the_voice_and_refused_speaks_leave_the_session(tmp_path):
    async with serving(tmp_path) as serve:
        session = await open_session(serve.sip_address)
        control = session.control
        await speak(session, 1, "One two three.")
        assert (await control.read()).state == "IN-PROGRESS"
        assert (await control.read()).event == "SPEAK-COMPLETE"
        english = session.rtp.audio("PCMU")
        session.rtp.packets.clear()

        control.send("SET-PARAMS", 2, session.channel, {"Voice-Name": "zh", "Prosody-Rate": "fast",
                                                        "Speech-Language": "zh-CN"})
        assert (await control.read()).status == 200
        control.send("GET-PARAMS", 3, session.channel, {"Voice-Name": "", "Prosody-Rate": ""})
        got = await control.read()
        assert (got.status, got.headers["Voice-Name"], got.headers["Prosody-Rate"]) == (200, "zh", "fast")
        await speak(session, 4, "One two three.")
        assert (await control.read()).state == "IN-PROGRESS"
        assert (await control.read()).headers["Completion-Cause"] == "000 normal"
        event = await serve.wait_for_event("mrcp_speak")
        while event["request_id"] != 4:
            event = await serve.wait_for_event("mrcp_speak")
        assert event["voice"] == "zh"
        chinese = session.rtp.audio("PCMU")
        assert rms(chinese) > 0.03 and chinese.size != english.size  # another voice, another sound

        refusals = [
            ({"Voice-Name": "klingon"}, "text/plain", b"Hello.", "004 error"),  # an unknown voice
            ({}, "application/ssml+xml", b"<speak>unclosed", "002 parse-failure"),
            ({}, "text/plain", b"\x01\x02", "002 parse-failure"),  # the text checks of every call
            ({}, "text/uri-list", b"http://example.com/a.ssml", "003 uri-failure"),
        ]
        for request_id, (headers, kind, body, cause) in enumerate(refusals, start=5):
            control.send("SPEAK", request_id, session.channel, headers, body, kind)
            refused = await control.read()
            assert (refused.request_id, refused.status, refused.state) == (request_id, 407, "COMPLETE")
            assert refused.headers["Completion-Cause"] == cause
            assert refused.headers["Completion-Reason"].startswith('"')
        request_id = 5 + len(refusals)
        # the session is intact: a SPEAK naming a known voice is spoken
        await speak(session, request_id, "Back to English.", {"Voice-Name": "en"})
        assert (await control.read()).state == "IN-PROGRESS"
        assert (await control.read()).headers["Completion-Cause"] == "000 normal"
        await session.close()

        fresh = await open_session(serve.sip_address)
        await speak(fresh, 1, "Bonjour.", {"Speech-Language": "fr-FR"})
        refused = await fresh.control.read()
        assert (refused.status, refused.headers["Completion-Cause"]) == (407, "005 language-unsupported")
        await speak(fresh, 2, "Hello.", {"Speech-Language": "en-US"})  # en-US -> the en voice
        assert (await fresh.control.read()).state == "IN-PROGRESS"
        await fresh.close()


async def test_malformed_messages_get_their_status_and_hurt_nobody(tmp_path):
    async with serving(tmp_path, "mrcp.max_message_bytes=4096") as serve:
        session = await open_session(serve.sip_address)
        channel, port = session.channel, session.leg.control_port
        control = session.control

        async def status_of(send) -> int:
            send(control)
            return (await control.read()).status

        # each on the shared connection, which stays usable
        assert await status_of(lambda c: c.send("FROB", 1, channel)) == 401
        assert await status_of(lambda c: c.send("PAUSE", 2, channel)) == 402
        assert await status_of(lambda c: c.send("SET-PARAMS", 3, channel, {"X-Bogus": "1"})) == 403
        assert await status_of(lambda c: c.send("SET-PARAMS", 4, channel, {"Kill-On-Barge-In": "maybe"})) == 404
        assert await status_of(lambda c: c.send("STOP", 5, "0123456789abcdef@speechsynth")) == 405
        assert await status_of(lambda c: c.send("STOP", 6, None)) == 406
        assert await status_of(lambda c: c.send("SPEAK", 7, channel, {"Content-Type": "text/plain"})) == 406
        assert await status_of(lambda c: c.send("SPEAK", 8, channel, body=b"x", content_type="audio/wav")) == 409
        assert await status_of(lambda c: c.send("STOP", 8, channel)) == 410  # request-id not increasing
        assert await status_of(lambda c: c.send("STOP", 9, channel, version="MRCP/1.0")) == 502
        wrong_length = (f"MRCP/2.0 LLL SPEAK 10\r\nChannel-Identifier: {channel}\r\n"
                        "Content-Length: 50\r\n\r\n").encode()  # 50 body bytes said, none sent
        wrong_length = wrong_length.replace(b"LLL", b"%d" % len(wrong_length))
        assert await status_of(lambda c: c.send_raw(wrong_length)) == 408
        assert await status_of(lambda c: c.send("GET-PARAMS", 11, channel)) == 200

        # what cannot be framed is answered, then its connection closes; the session carries on elsewhere
        for garbage, status in ((b"HELLO MRCP\r\n\r\n", 408), (b"MRCP/2.0 99999 SPEAK 12\r\n", 504)):
            broken = await Control.connect(port)
            broken.send_raw(garbage)
            assert (await broken.read()).status == status
            assert await broken.closed()
        other = await Control.connect(port)
        other.send("SPEAK", 20, channel, body=b"Still speaking.")
        assert (await other.read()).state == "IN-PROGRESS"
        assert (await other.read()).headers["Completion-Cause"] == "000 normal"
        await session.close()

        # and another session is served as ever
        second = await open_session(serve.sip_address)
        await speak(second, 1, "A new session.")
        assert (await second.control.read()).state == "IN-PROGRESS"
        assert (await second.control.read()).headers["Completion-Cause"] == "000 normal"
        await second.close()
        assert "Traceback" not in serve.tail(200000)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificate")
async def test_a_speak_over_tls(tmp_path):
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1"], check=True, capture_output=True)
    tls = f"mrcp.tls={{listen: '127.0.0.1:{free_port(1)}', cert: '{cert}', key: '{key}'}}"
    async with serving(tmp_path, tls) as serve:
        session = await open_session(serve.sip_address, tls=True)
        assert "m=application" in session.leg.answer and "TCP/TLS/MRCPv2" in session.leg.answer
        await speak(session, 1, "Spoken over TLS.")
        assert (await session.control.read()).state == "IN-PROGRESS"
        assert (await session.control.read()).headers["Completion-Cause"] == "000 normal"
        assert rms(session.rtp.audio("PCMU")) > 0.03
        await session.close()
        # a plain TCP connection to the TLS port gets nothing it could read as MRCP
        plain = await Control.connect(session.leg.control_port)
        plain.send("GET-PARAMS", 1, session.channel)
        assert await plain.closed()


async def test_an_mrcp_offer_without_mrcp_enabled_gets_488(tmp_path):
    serve = await start_serve(tmp_path, None, "shutdown.drain_timeout_s=1", engine="instant")
    try:
        await serve.wait_healthy()
        rtp = await rtp_recorder()
        refused = await invite(serve.sip_address, rtp.port)
        assert refused.status.startswith("SIP/2.0 488"), refused.status
        rtp.transport.close()
    finally:
        assert await serve.stop() == 0


async def test_a_session_whose_client_is_gone_is_ended_with_bye(tmp_path):
    async with serving(tmp_path, "mrcp.unattached_timeout_s=1") as serve:
        rtp = await rtp_recorder()
        never = await invite(serve.sip_address, rtp.port)  # answered, but never opens its control connection
        await never.wait_for_bye(timeout=10)
        left = await open_session(serve.sip_address)  # connects, is served, then its connection closes
        left.control.send("GET-PARAMS", 1, left.channel)
        assert (await left.control.read()).status == 200
        left.control.close()
        await left.leg.wait_for_bye(timeout=10)
        for _ in range(2):
            event = await serve.wait_for_event("mrcp_session_ended")
            assert event["outcome"] == "client_lost"
        rtp.transport.close()
        left.rtp.transport.close()


async def test_many_sessions_at_once_each_hear_their_speak(tmp_path):
    async with serving(tmp_path) as serve:
        sessions = await asyncio.gather(*(open_session(serve.sip_address) for _ in range(8)))
        assert len({session.channel for session in sessions}) == 8
        for number, session in enumerate(sessions):
            await speak(session, 1, f"Session number {number}.")
        for session in sessions:
            assert (await session.control.read()).state == "IN-PROGRESS"
            done = await session.control.read(timeout=30)
            assert (done.event, done.headers["Completion-Cause"]) == ("SPEAK-COMPLETE", "000 normal")
            assert rms(session.rtp.audio("PCMU")) > 0.03
            assert_framed(session)
        await asyncio.gather(*(session.close() for session in sessions))


async def test_the_engine_slot_decides_sessions_and_speaks(tmp_path):
    """One engine slot (a worker, realtime instant engine): a SPEAK holds it while it speaks; meanwhile another
    session's SPEAK fails with 004 and a new session is refused with 503, as a call would be; after STOP both go."""
    serve = await start_serve(tmp_path, None, "mrcp.enabled=true", f"mrcp.listen=127.0.0.1:{free_port(1)}",
                              "media.rtp_port_range=43000-43999", "shutdown.drain_timeout_s=1", "engine.workers=1",
                              "engine.worker.slots=1", "engine.instant.realtime=true", engine="instant")
    try:
        await serve.wait_healthy(status="ok")
        first, second = await open_session(serve.sip_address), await open_session(serve.sip_address)
        await speak(first, 1, LONG_TEXT)
        assert (await first.control.read()).state == "IN-PROGRESS"
        while (await serve.healthz())[1].get("status") != "full":
            await asyncio.sleep(0.05)
        await speak(second, 1, "No room for me.")
        refused = await second.control.read()
        assert (refused.status, refused.headers["Completion-Cause"]) == (407, "004 error")
        rtp = await rtp_recorder()
        assert (await invite(serve.sip_address, rtp.port)).status.startswith("SIP/2.0 503")
        rtp.transport.close()
        first.control.send("STOP", 2, first.channel)
        assert (await first.control.read()).status == 200
        await serve.wait_healthy(status="ok")
        third = await open_session(serve.sip_address)
        await speak(second, 2, "Now there is room.")
        assert (await second.control.read()).state == "IN-PROGRESS"
        await asyncio.gather(first.close(), second.close(), third.close())
    finally:
        assert await serve.stop() == 0


async def test_an_engine_failing_mid_speak_ends_that_speak_with_004_not_the_session(tmp_path):
    serve = await start_serve(tmp_path, None, "mrcp.enabled=true", f"mrcp.listen=127.0.0.1:{free_port(1)}",
                              "media.rtp_port_range=43000-43999", "shutdown.drain_timeout_s=1", "engine.workers=1",
                              "engine.instant.realtime=true", engine="instant")
    try:
        await serve.wait_healthy(status="ok")
        session = await open_session(serve.sip_address)
        await speak(session, 1, LONG_TEXT)
        assert (await session.control.read()).state == "IN-PROGRESS"
        await session.rtp.wait_for_packets(10)
        children = Path(f"/proc/{serve.process.pid}/task/{serve.process.pid}/children").read_text().split()
        (worker,) = [int(pid) for pid in children if b"engine_service" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(worker, signal.SIGKILL)
        failed = await session.control.read(timeout=30)
        assert (failed.event, failed.request_id, failed.headers["Completion-Cause"]) == ("SPEAK-COMPLETE", 1,
                                                                                          "004 error")
        await serve.wait_healthy(status="ok", timeout_s=60)  # the supervisor started a new worker
        await speak(session, 2, "Back again.")
        assert (await session.control.read()).state == "IN-PROGRESS"
        assert (await session.control.read(timeout=30)).headers["Completion-Cause"] == "000 normal"
        await session.close()
    finally:
        assert await serve.stop() == 0


async def test_a_session_while_full_is_refused_with_503(tmp_path):
    async with serving(tmp_path, "sip.max_calls=1") as serve:
        session = await open_session(serve.sip_address)
        rtp = await rtp_recorder()
        refused = await invite(serve.sip_address, rtp.port)
        assert refused.status.startswith("SIP/2.0 503"), refused.status
        assert session.leg.status.startswith("SIP/2.0 200")
        await session.close()
        rtp.transport.close()
