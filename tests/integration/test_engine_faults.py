"""One bad INVITE must never silence the gateway: bad text is refused before answer, a request that breaks the
engine fails its own call only, and a dead or hung engine is seen (OPTIONS, INVITE and /healthz say 503) and
restarted. Real SIPp callers and raw SIP sockets against a whole gateway on loopback, with the real eSpeak engine;
the faults are injected by engine subclasses that die or hang on one marked text."""

from __future__ import annotations

import asyncio
import shutil
import threading

import aiohttp
import numpy as np
import pytest
from integration_harness import SCENARIOS, invite_final_response, options_status, rtp_recorder, run_sipp, start_gateway

from engines.espeak import EspeakEngine
from gateway import metrics
from gateway.engine_watchdog import WatchdogSettings
from gateway.http_api import start_http, stop_http

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(120),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

DIE = "please die now"
HANG = "please hang now"


class FaultyEspeak(EspeakEngine):
    """Real eSpeak, except that the marked texts kill the speech thread or hang it; restarts wait for a gate."""

    def __init__(self, **settings) -> None:
        super().__init__(**settings)
        self.restart_requested = asyncio.Event()
        self.restart_allowed = asyncio.Event()
        self.release_hang = threading.Event()

    def _speak(self, job, stopping) -> None:
        if job.text == DIE:
            raise SystemExit("injected: the speech thread dies")  # not an Exception: escapes the per-job catch
        if job.text == HANG:
            self.release_hang.wait(30)  # a hang in the C library, as the thread sees it
            return
        super()._speak(job, stopping)

    async def restart(self) -> None:
        self.restart_requested.set()
        await self.restart_allowed.wait()
        await super().restart()


async def _normal_call_is_spoken(gateway, tmp_path) -> None:
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, tmp_path, keys={
        "text": "Hello caller, the gateway still speaks.", "rtp_rx": str(recorder.port),
        "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    audio = recorder.audio("PCMU").astype(np.float64)
    assert len(recorder.packets) > 50 and np.sqrt(np.mean(audio**2)) > 500


@pytest.fixture
async def gateway():
    gw = await start_gateway("espeak")
    yield gw
    await gw.stop()


BAD_TEXTS = {
    "raw bytes that are not UTF-8": b"hello \xff\xfe caller",
    "percent-encoded bytes that are not UTF-8": "hello%FF%FEcaller",
    "percent-encoded NUL cutting the text": "hello%00caller",
    "raw control character": b"hello \x07 caller",
    "percent-encoded control character": "hello%1Bcaller",
    "punctuation only": "...?!",
}


async def test_bad_text_is_refused_before_answer_and_the_gateway_still_speaks(gateway, tmp_path):
    for case, text in BAD_TEXTS.items():
        status = await invite_final_response(gateway.sip.udp_address, {"X-TTS-Text": text})
        assert status.startswith("SIP/2.0 400 "), (case, status)
    assert gateway.watchdog.check_now().state == "ready"
    await _normal_call_is_spoken(gateway, tmp_path)


async def test_a_request_that_breaks_synthesis_fails_only_its_own_stream():
    """Bypassing validation (as a future bug might), bad text reaches the engine: its stream fails, the next works."""
    engine = EspeakEngine()
    await engine.start()
    try:
        from engines.base import SynthesisFailed, SynthesisRequest
        engine.validate = lambda request: None  # the bug: a request that slips past validation
        bad = engine.open_stream(SynthesisRequest(text="caller \udcff here", voice="en"))
        with pytest.raises(SynthesisFailed):
            async for _ in bad:
                pass
        good = engine.open_stream(SynthesisRequest(text="still speaking", voice="en"))
        chunks = [chunk async for chunk in good]
        assert sum(len(c) for c in chunks) > 0
        assert engine.health().state == "ready"
    finally:
        await engine.close()


async def _healthz(gateway) -> tuple[int, dict]:
    http = await start_http(gateway.status, "127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session, \
                session.get(f"http://127.0.0.1:{http.port}/healthz") as response:
            return response.status, await response.json()
    finally:
        await stop_http(http)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the injected death
@pytest.mark.parametrize("fault", [DIE, HANG])
async def test_dead_or_hung_engine_is_refused_reported_and_restarted(tmp_path, fault):
    engine = FaultyEspeak(stuck_after_s=0.5)
    gw = await start_gateway("espeak", engine_obj=engine, watchdog=WatchdogSettings(interval_s=0.1))
    restarts_before = metrics.registry.get_sample_value("gateway_engine_restarts_total") or 0
    try:
        assert await options_status(gw.sip.udp_address) == "SIP/2.0 200 OK"
        # The faulty call is answered (its text is fine) and then the engine breaks under it.
        recorder = await rtp_recorder()
        faulty_call = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gw.sip.udp_address, tmp_path, keys={
            "text": fault, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"}))
        await asyncio.wait_for(engine.restart_requested.wait(), 10)

        # While it is down: qualify pings and new calls get 503, /healthz says so.
        assert (await options_status(gw.sip.udp_address)).startswith("SIP/2.0 503 ")
        assert (await invite_final_response(gw.sip.udp_address, {"X-TTS-Text": "hello"})).startswith("SIP/2.0 503 ")
        status, body = await _healthz(gw)
        assert status == 503 and body["engine_state"] == "down", body

        restarted = gw.watchdog.restarted
        engine.restart_allowed.set()
        await asyncio.wait_for(restarted.wait(), 10)
        rc, errors = await asyncio.wait_for(faulty_call, 30)  # the broken call got its BYE
        recorder.transport.close()
        assert rc == 0, errors
        assert (metrics.registry.get_sample_value("gateway_engine_restarts_total") or 0) == restarts_before + 1

        assert await options_status(gw.sip.udp_address) == "SIP/2.0 200 OK"
        status, body = await _healthz(gw)
        assert status == 200 and body["engine_state"] == "ready", body
        await _normal_call_is_spoken(gw, tmp_path)
    finally:
        engine.release_hang.set()
        engine.restart_allowed.set()
        await gw.stop()
