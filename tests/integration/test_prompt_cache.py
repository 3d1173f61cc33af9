"""The prompt cache on whole calls: SIPp callers over loopback, the gateway in the test's loop with a real engine.

The engine's own count of streams opened (`SpeechEngine.streams_opened`, incremented in the engine's open_stream)
is what says whether it was asked; the cache's counts are read from the gateway's Prometheus registry.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from engines.base import SynthesisRequest
from gateway import metrics
from integration_harness import (SCENARIOS, free_udp_port, invite_final_response, rtp_recorder, run_sipp,
                                 start_gateway)
from supervised_serve import listening_call, stop_serve
from supervised_serve import start_serve as start_supervised
from speech_audio import g711
from speech_audio.level import active_speech_dbm0
from tests.gateway.sip.peers import free_media_port

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(600),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

PROMPT = "Welcome."
# 1,000 by default; PROMPT_CACHE_CALLS lowers it on a box too busy for a 40 s run.
CALLS = int(os.environ.get("PROMPT_CACHE_CALLS", "1000"))


def _sample(name: str, labels: dict | None = None) -> float:
    return metrics.registry.get_sample_value(name, labels or {}) or 0.0


def _hits() -> float:
    return sum(_sample("gateway_prompt_cache_hits_total", {"where": w}) for w in ("memory", "disk", "in_flight"))


async def _gateway(directory: Path, engine: str = "espeak", **extra):
    routes = {"prompts": {"welcome": {"text": PROMPT, "voice": "en", "prerender": True}},
              "routes": [{"match": "1000", "prompt": "welcome"}]}
    # 50 calls a second from one SIPp source is over sip.flood's default 100 requests a second (INVITE + ACK + ...),
    # and the all-sources bound may not be below it.
    # T1 500 ms (RFC 3261's default) rather than the harness's 50: at 50 calls a second on a shared 2-core box a
    # BYE's 200 may take longer than 50 ms, and SIPp counts the retransmitted BYE as a failed ("dead") call.
    return await start_gateway(engine, t1_ms=500, extra={**routes, "prompt_cache.directory": str(directory),
                                              "sip.max_calls": 500, "sip.flood.max_requests_per_s_per_source": 2000,
                                              "sip.flood.max_requests_per_s": 2000, **extra})


async def _sipp_many(gateway, workdir: Path, rtp_rx: int, calls: int, rate: int) -> tuple[int, str]:
    """`calls` routed calls to 1000, `rate` new ones a second, overlapping (each lasts its prompt, ~0.6 s)."""
    address = gateway.sip.udp_address
    command = ["sipp", f"{address[0]}:{address[1]}", "-sf", str(SCENARIOS / "gw_route_listen.xml"), "-s", "1000",
               "-m", str(calls), "-r", str(rate), "-l", str(4 * rate), "-t", "u1", "-i", "127.0.0.1",
               "-p", str(free_udp_port()), "-mp", str(free_media_port()), "-key", "rtp_rx", str(rtp_rx),
               "-key", "codec_pt", "0", "-key", "codec_name", "PCMU", "-timeout", "300s", "-timeout_error",
               "-trace_err", "-nostdin"]
    process = await asyncio.create_subprocess_exec(*command, cwd=workdir, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), 330)
    errors = stderr.decode(errors="replace") + "".join(p.read_text(errors="replace") for p in workdir.glob("*errors*"))
    return process.returncode, errors


async def _heard(gateway, workdir: Path, text: str, scenario: str = "gw_listen_cached.xml") -> np.ndarray:
    recorder = await rtp_recorder()
    rc, errors = await run_sipp(SCENARIOS / scenario, gateway.sip.udp_address, workdir, keys={
        "text": text, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    assert await gateway.calls_ended(5)
    return recorder.audio("PCMU")


async def test_calls_to_a_prerendered_prompt_never_ask_the_engine(tmp_path):
    gateway = await _gateway(tmp_path / "cache")
    try:
        await gateway.prerender(gateway.resolve_prompt.prerendered())
        asked = gateway.engine.streams_opened  # the voice's level measurement and the prompt, once each
        assert asked == 2
        hits_before = _hits()
        sent_before = _sample("gateway_rtp_packets_sent_total")
        completed_before = _sample("gateway_calls_total", {"outcome": "completed"})
        recorder = await rtp_recorder()
        rc, errors = await _sipp_many(gateway, tmp_path, recorder.port, CALLS, rate=50)
        assert rc == 0, errors
        assert await gateway.calls_ended(10)
        recorder.transport.close()
        assert gateway.engine.streams_opened == asked  # the engine was asked zero times for CALLS calls
        assert _hits() - hits_before == CALLS
        prompt = await gateway.speech.cache.lookup(gateway.speech.key(SynthesisRequest(text=PROMPT, voice="en")))
        per_call = -(-prompt.size // 160)
        assert _sample("gateway_calls_total", {"outcome": "completed"}) - completed_before == CALLS
        # every caller was sent the whole prompt; one Python socket receiving 2,500 packets a second may drop some
        assert _sample("gateway_rtp_packets_sent_total") - sent_before == CALLS * per_call
        assert len(recorder.packets) >= 0.9 * CALLS * per_call
    finally:
        await gateway.stop()


async def test_the_prerender_at_start_asks_the_engine_for_unpaced_streams(tmp_path):
    """The start's prerender (the voice's level, then the prompt) collects each render whole before anyone hears
    it, so its engine streams are unpaced (SynthesisRequest.paced False): not rendered in real time."""
    gateway = await _gateway(tmp_path / "cache")
    opened: list[SynthesisRequest] = []
    open_stream = gateway.engine.open_stream

    def recording_open(request: SynthesisRequest):
        opened.append(request)
        return open_stream(request)

    gateway.engine.open_stream = recording_open
    try:
        await gateway.prerender(gateway.resolve_prompt.prerendered())
        assert [r.paced for r in opened] == [False, False] and opened[-1].text == PROMPT
    finally:
        await gateway.stop()


@pytest.mark.parametrize("damage", ["flip", "truncate"])
async def test_a_damaged_cache_file_is_discarded_and_rendered_again_never_played(tmp_path, damage):
    directory = tmp_path / "cache"
    text = f"Your order number is four two {damage}."
    gateway = await _gateway(directory)
    try:
        await gateway.prerender(gateway.resolve_prompt.prerendered())  # as at start: the voice's level measured
        first = await _heard(gateway, tmp_path, text)
        key = gateway.speech.key(SynthesisRequest(text=text, voice="en"))
        await asyncio.gather(*gateway.speech.cache._tasks)  # the file is on disk
        path = gateway.speech.cache.store.path_of(key)
        assert path.exists()
    finally:
        await gateway.stop()
    data = bytearray(path.read_bytes())
    if damage == "flip":
        for at in range(200, len(data), 97):
            data[at] ^= 0xA5
    else:
        del data[len(data) // 3:]
    path.write_bytes(bytes(data))

    corrupt_before = _sample("gateway_prompt_cache_corrupt_files_total")
    restarted = await _gateway(directory)  # a new process's view: empty memory, the same directory
    try:
        heard = await _heard(restarted, tmp_path, text)
        assert _sample("gateway_prompt_cache_corrupt_files_total") - corrupt_before == 1
        # rendered again, and only that: the voice's level came from its calibration audio on disk
        assert restarted.engine.streams_opened == 1
        # the caller hears the new rendering, sample for sample, never the damaged file's bytes
        entry = restarted.speech.cache.store.memory_get(key)
        expected = g711.decode(g711.encode(entry, "PCMU"), "PCMU")
        assert np.array_equal(heard[: expected.size], expected) and not heard[expected.size:].any()
        assert abs(heard.size - first.size) <= 800  # the same words (espeak varies by a few ms between runs)
        assert active_speech_dbm0(heard, 8000) > -25.0  # speech, not silence
        await asyncio.gather(*restarted.speech.cache._tasks)
        assert restarted.speech.cache.store.disk_get(key) is not None  # and the good audio is kept again
    finally:
        await restarted.stop()


async def test_two_calls_missing_the_same_prompt_at_once_cause_one_synthesis(tmp_path):
    # The instant engine with a 400 ms first-chunk delay: the second INVITE surely arrives while the first
    # call's render is still running.
    gateway = await start_gateway("instant", engine_settings={"first_chunk_delay_ms": 400},
                                  extra={"prompt_cache.directory": str(tmp_path / "cache")})
    try:
        await gateway.speech.gain_db("en")  # the voice's level is measured before the calls
        asked = gateway.engine.streams_opened
        in_flight_before = _sample("gateway_prompt_cache_hits_total", {"where": "in_flight"})
        text = "Please hold, an agent will be with you shortly."
        first, second = await asyncio.gather(_heard(gateway, tmp_path / "a", text),
                                             _heard(gateway, tmp_path / "b", text))
        assert gateway.engine.streams_opened == asked + 1
        assert _sample("gateway_prompt_cache_hits_total", {"where": "in_flight"}) - in_flight_before == 1
        assert first.size > 8000 and np.array_equal(first, second)  # both heard the whole prompt, the same
    finally:
        await gateway.stop()


@pytest.fixture(autouse=True)
def _workdirs(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()


async def test_a_full_engine_still_answers_a_cached_prompt_and_refuses_an_uncached_one(tmp_path):
    """One worker with one slot, held by a long uncached call (the instant engine in real time): the engine is
    full. A call to the prerendered prompt is answered all the same (a hit takes no slot); a new text gets 503."""
    serve = await start_supervised(tmp_path, {"name": "instant", "workers": 1, "worker": {"slots": 1},
                                              "instant": {"realtime": True}},
                                   extra={"prompts": {"welcome": {"text": PROMPT, "voice": "en", "prerender": True}},
                                          "routes": [{"match": "1000", "prompt": "welcome"}]})
    try:
        await serve.until_healthy(slots_free=1)
        for _ in range(600):  # the start's prerender (voice level, 12 s in real time, then the prompt) comes first
            if await serve.metric("gateway_prompt_cache_misses_total") >= 2 and \
                    (await serve.healthz())[1]["slots_free"] == 1:
                break
            await asyncio.sleep(0.1)  # polling the gateway's metrics, not pacing media
        call, recorder = await listening_call(serve, tmp_path, "This call holds the only engine slot. " * 4, "long")
        await recorder.wait_for_packets(5, timeout_s=20)
        status, body = await serve.healthz()
        assert status == 503 and body["status"] == "full"  # OPTIONS and /healthz still say full

        assert (await invite_final_response(serve.sip, {}, user="1000")).startswith("SIP/2.0 200")
        assert (await invite_final_response(serve.sip, {"X-TTS-Text": "a new text"})).startswith("SIP/2.0 503")
        assert await serve.metric('gateway_prompt_cache_hits_total{where="memory"}') >= 1
        assert not call.done()  # the long call goes on
    finally:
        await stop_serve(serve)
