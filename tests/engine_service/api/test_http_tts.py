"""POST /v1/tts and GET /v1/voices with a real aiohttp client over loopback."""

from __future__ import annotations

import io
import wave

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from engine_service.api import add_tts_routes
from engine_service.api.context import TTS_API
from speech_audio import g711
from engines.base import SynthesisRequest
from tests.engine_service.api.api_server import AUTH, OTHER_KEY, GatedEngine, serve, serve_app, settings, until

pytestmark = pytest.mark.timeout(60)

TEXT = "The quick brown fox jumps over the lazy dog, twice."


async def engine_samples(engine, text: str) -> int:
    channel = engine.open_stream(SynthesisRequest(text=text, voice="en"))
    return sum([len(chunk) async for chunk in channel])


@pytest.mark.parametrize(("audio_format", "rate", "content_type", "width"), [
    ("wav", 24000, "audio/wav", 2),
    ("wav", 8000, "audio/wav", 2),
    ("pcm_s16le", 16000, "audio/l16;rate=16000", 2),
    ("pcm_s16le", 8000, "audio/l16;rate=8000", 2),
    ("pcmu", 8000, "audio/PCMU;rate=8000", 1),
    ("pcma", 8000, "audio/PCMA;rate=8000", 1),
])
async def test_formats_decode_to_the_rate_and_length_of_the_speech(espeak, audio_format, rate, content_type, width):
    expected = await engine_samples(espeak, TEXT) * rate / 24000
    async with serve(espeak) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts",
                               json={"text": TEXT, "format": audio_format, "sample_rate": rate}) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == content_type
            assert response.headers["Transfer-Encoding"] == "chunked"
            body = await response.read()
    if audio_format == "wav":
        with wave.open(io.BytesIO(body)) as reader:
            assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (rate, 1, 2)
            samples = np.frombuffer(reader.readframes(10**7), dtype="<i2")
    else:
        samples = np.frombuffer(body, dtype="<i2" if width == 2 else np.uint8)
    assert abs(len(samples) - expected) <= 0.02 * expected  # espeak's length varies by a few ms per run
    if width == 2:
        assert np.abs(samples.astype(np.int32)).max() > 3000  # speech, not silence


async def test_g711_body_is_the_companded_pcm_of_the_same_request():
    from engines.instant import InstantEngine  # deterministic: the same text gives the same samples

    engine = InstantEngine()
    await engine.start()
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": TEXT, "format": "pcm_s16le",
                                                            "sample_rate": 8000}) as response:
            pcm = np.frombuffer(await response.read(), dtype="<i2")
        async with client.post(f"{server.url}/v1/tts", json={"text": TEXT, "format": "pcmu"}) as response:
            assert await response.read() == g711.encode(pcm, "PCMU")


async def test_ssml_is_spoken_segment_by_segment_and_malformed_ssml_is_400_bad_ssml():
    engine = GatedEngine(chunks=1)  # 100 ms of a constant level per piece of speech
    document = '<speak>Balance <say-as interpret-as="cardinal">12</say-as><break time="200ms"/>余额</speak>'
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": document, "format": "pcm_s16le"}) as response:
            assert response.status == 200
            pcm = np.frombuffer(await response.read(), dtype="<i2")
        async with client.post(f"{server.url}/v1/tts", json={"text": "<speak>Balance <break>"}) as response:
            assert response.status == 400
            error = await response.json()
    assert engine.texts == ["Balance twelve", "余额"]
    assert len(pcm) == 2400 + 4800 + 2400 and not pcm[2400:7200].any()
    assert error["error"] == "bad_ssml" and "not well-formed" in error["message"]


async def test_first_bytes_arrive_before_synthesis_ends():
    engine = GatedEngine(chunks=5)
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": "hello", "format": "pcm_s16le"}) as response:
            assert response.status == 200
            first = await response.content.readany()  # the engine holds the other four chunks until the gate opens
            assert len(first) == 2400 * 2 and not engine.gate.is_set()
            engine.gate.set()
            rest = await response.read()
    assert len(first) + len(rest) == engine.samples_per_stream * 2


@pytest.mark.parametrize(("body", "headers", "status", "reason"), [
    (b'{"text": "hi"', AUTH, 400, "bad_json"),
    (b'["hi"]', AUTH, 400, "bad_json"),
    (b'\xff\xfe{}', AUTH, 400, "bad_json"),
    (b'{"text": "hi", "voice": "klingon"}', AUTH, 400, "unknown_voice"),
    (b'{"text": "hi", "sampleRate": 8000}', AUTH, 400, "invalid_field"),
    (b'{"text": 5}', AUTH, 400, "invalid_field"),
    (b'{"text": "hi", "format": "mp3"}', AUTH, 400, "invalid_field"),
    (b'{"text": "   "}', AUTH, 400, "empty_text"),
    (b'{"text": "bell\\u0007"}', AUTH, 400, "bad_text"),
    (b'{"text": "' + b"a" * 501 + b'"}', AUTH, 413, "text_too_long"),
    (b'{"text": "hi"}', {}, 401, "missing_api_key"),
    (b'{"text": "hi"}', {"Authorization": "Basic dXNlcjpwYXNz"}, 401, "missing_api_key"),
    (b'{"text": "hi"}', {"Authorization": "Bearer not-a-key-at-all-000"}, 401, "invalid_api_key"),
])
async def test_bad_requests_get_their_specific_error_and_harm_nothing(espeak, body, headers, status, reason):
    async with serve(espeak, settings(max_text_chars=500)) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/tts", data=body, headers=headers) as response:
            assert response.status == status
            assert (await response.json())["error"] == reason
            if status == 401:
                assert response.headers["WWW-Authenticate"].startswith("Bearer")
        async with client.post(f"{server.url}/v1/tts", json={"text": "still fine"}, headers=AUTH) as response:
            assert response.status == 200 and len(await response.read()) > 1000


async def test_per_key_stream_limit_is_429_and_a_finished_stream_gives_its_slot_back():
    engine = GatedEngine()
    other = {"Authorization": f"Bearer {OTHER_KEY}"}  # max_streams: 1
    async with serve(engine) as server, aiohttp.ClientSession(headers=other) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": "one"}) as first:
            await first.content.readany()
            async with client.post(f"{server.url}/v1/tts", json={"text": "two"}) as second:
                assert second.status == 429
                assert (await second.json())["error"] == "too_many_streams"
            async with client.post(f"{server.url}/v1/tts", json={"text": "two"}, headers=AUTH) as other_key:
                assert other_key.status == 200  # limits are per key
                other_key.close()
            engine.gate.set()
            await first.read()
        async with client.post(f"{server.url}/v1/tts", json={"text": "three"}) as third:
            assert third.status == 200


async def test_client_that_disconnects_mid_stream_frees_its_slot_and_the_engine_stream():
    engine = GatedEngine(chunks=50)
    async with serve(engine) as server:
        slots = server.app[TTS_API].slots
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {OTHER_KEY}"}) as client:
            response = await client.post(f"{server.url}/v1/tts", json={"text": "long"})
            await response.content.readany()
            assert slots.in_use("other") == 1
            response.close()  # drop the connection mid-stream
        engine.gate.set()
        await until(lambda: slots.in_use("other") == 0)
        assert engine.channels[0].cancelled


async def test_an_engine_that_does_not_admit_in_time_is_a_503_with_retry_after_not_a_stall():
    async with serve(GatedEngine(admit=False), settings(admission_timeout_s=0.2, retry_after_s=3)) as server:
        async with aiohttp.ClientSession(headers=AUTH) as client:
            async with client.post(f"{server.url}/v1/tts", json={"text": "hello"}) as response:
                assert response.status == 503
                assert response.headers["Retry-After"] == "3"
                assert (await response.json())["error"] == "at_capacity"


async def test_an_engine_that_is_down_is_a_503_engine_unavailable():
    from engines.espeak import EspeakEngine

    async with serve(EspeakEngine()) as server, aiohttp.ClientSession(headers=AUTH) as client:  # never started
        async with client.post(f"{server.url}/v1/tts", json={"text": "hello"}) as response:
            assert response.status == 503 and "Retry-After" in response.headers
            assert (await response.json())["error"] == "engine_unavailable"


async def test_a_mid_stream_engine_failure_truncates_the_body_instead_of_ending_it():
    engine = GatedEngine(fail_after_first=True)
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": "hello"}) as response:
            assert response.status == 200
            await response.content.readany()
            engine.gate.set()
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()


async def test_voices_lists_the_engine_s_voices_and_needs_a_key(espeak):
    async with serve(espeak) as server, aiohttp.ClientSession() as client:
        async with client.get(f"{server.url}/v1/voices") as response:
            assert response.status == 401
        async with client.get(f"{server.url}/v1/voices", headers=AUTH) as response:
            body = await response.json()
    assert [voice["name"] for voice in body["voices"]] == ["en", "zh"]
    assert body["default_voice"] == "en" and body["sample_rates"] == [8000, 16000, 24000]


class WorkerSlots:
    """What the worker passes as SharedSlots: its one count of engine streams, gateways' and ours."""

    def __init__(self, total: int) -> None:
        self.total, self.in_use = total, 0

    def take(self, keep_free: int = 0) -> bool:
        if self.in_use >= self.total - keep_free:
            return False
        self.in_use += 1
        return True

    def give_back(self) -> None:
        self.in_use -= 1


async def test_api_streams_count_against_the_worker_s_shared_slots():
    engine, worker_slots = GatedEngine(), WorkerSlots(total=1)
    app = web.Application()
    add_tts_routes(app, engine, settings(), shared_slots=worker_slots)
    async with serve_app(app) as url, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{url}/v1/tts", json={"text": "one"}) as first:
            await first.content.readany()
            assert worker_slots.in_use == 1
            async with client.post(f"{url}/v1/tts", json={"text": "two"}) as second:
                assert second.status == 503 and "Retry-After" in second.headers
                assert (await second.json())["error"] == "at_capacity"
            engine.gate.set()
            await first.read()
        async with client.post(f"{url}/v1/tts", json={"text": "three", "voice": "nope"}) as refused:
            assert refused.status == 400
    assert worker_slots.in_use == 0


async def test_default_sample_rate_applies_when_the_request_names_none():
    engine = GatedEngine(chunks=1)
    async with serve(engine, settings(default_sample_rate=8000)) as server, \
            aiohttp.ClientSession(headers=AUTH) as client:
        async with client.post(f"{server.url}/v1/tts", json={"text": "hi", "format": "pcm_s16le"}) as response:
            assert response.headers["Content-Type"] == "audio/l16;rate=8000"
            assert abs(len(await response.read()) - 800 * 2) <= 8


async def test_a_body_over_aiohttp_s_limit_is_a_json_413():
    async with serve(GatedEngine()) as server, aiohttp.ClientSession(headers=AUTH) as client:
        body = b'{"text": "' + b"a" * (2 * 2**20) + b'"}'
        async with client.post(f"{server.url}/v1/tts", data=body) as response:
            assert response.status == 413
            assert (await response.json())["error"] == "body_too_large"


async def test_a_wrong_path_or_method_is_the_documented_json_error_on_the_workers_server():
    """404 and 405 come from aiohttp's router, before any handler: still {"error", "message"} (issue #33)."""
    from engine_service.server import WorkerSettings, make_app
    from engines.instant import InstantEngine

    engine = InstantEngine()
    await engine.start()
    try:
        async with serve_app(make_app(engine, WorkerSettings(token="t", slots=4), settings())) as url, \
                aiohttp.ClientSession(headers=AUTH) as client:
            async with client.get(f"{url}/v1/speech") as response:
                assert response.status == 404 and response.content_type == "application/json"
                assert await response.json() == {"error": "not_found",
                                                 "message": "no route /v1/speech (docs/TTS_API.md lists them)"}
            async with client.get(f"{url}/v1/tts") as response:
                assert response.status == 405 and response.content_type == "application/json"
                assert response.headers["Allow"] == "POST"
                assert await response.json() == {"error": "method_not_allowed",
                                                 "message": "GET is not allowed on /v1/tts; use POST"}
            async with client.post(f"{url}/v1/tts", json={"text": "still served"}) as response:
                assert response.status == 200 and len(await response.read()) > 44
    finally:
        await engine.close()
