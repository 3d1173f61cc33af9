"""The OpenAI-compatible speech API (#34 item 3) driven by OpenAI's own Python client (`openai`), unchanged but
for its base_url, against the API's server around the espeak engine (or the gated engine, to see streaming)."""

from __future__ import annotations

import base64
import io
import json
import wave

import aiohttp
import numpy as np
import openai
import pytest

from engines.base import SynthesisRequest
from tests.engine_service.api.api_server import AUTH, KEY, OTHER_KEY, GatedEngine, serve, settings

pytestmark = pytest.mark.timeout(60)

TEXT = "Your balance is twelve dollars and forty cents."


def client(server, key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


async def engine_samples(engine, text: str) -> int:
    channel = engine.open_stream(SynthesisRequest(text=text, voice="en"))
    return sum([len(chunk) async for chunk in channel])


def near(value: float, expected: float) -> bool:
    return abs(value - expected) <= 0.02 * expected  # espeak's length varies by a few ms per run


async def test_wav_and_pcm_are_24_khz_speech_of_the_texts_length(espeak):
    expected = await engine_samples(espeak, TEXT)
    async with serve(espeak) as server:
        wav = await client(server).audio.speech.create(model="tts-1", voice="en", input=TEXT, response_format="wav")
        pcm = await client(server).audio.speech.create(model="tts-1", voice="en", input=TEXT, response_format="pcm")
    with wave.open(io.BytesIO(wav.content)) as reader:
        assert (reader.getframerate(), reader.getnchannels(), reader.getsampwidth()) == (24000, 1, 2)
        samples = np.frombuffer(reader.readframes(10**7), dtype="<i2")
    assert near(len(samples), expected) and np.abs(samples.astype(np.int32)).max() > 3000
    assert pcm.response.headers["content-type"] == "audio/pcm"
    assert near(len(pcm.content) / 2, len(samples))


async def test_mp3_is_the_default_and_holds_the_texts_duration(espeak):
    seconds = await engine_samples(espeak, TEXT) / 24000
    async with serve(espeak) as server:
        mp3 = await client(server).audio.speech.create(model="gpt-4o-mini-tts", voice="en", input=TEXT)
    assert mp3.response.headers["content-type"] == "audio/mpeg"
    assert mp3.content[:2] in (b"\xff\xf3", b"\xff\xf2", b"\xff\xfb", b"\xff\xfa")  # an MPEG audio frame
    assert 0.85 * seconds * 8000 < len(mp3.content) < 1.2 * seconds * 8000 + 1000  # 64 kbit/s


async def test_streaming_response_sends_audio_before_synthesis_ends():
    engine = GatedEngine(chunks=4)
    async with serve(engine) as server:
        async with client(server).audio.speech.with_streaming_response.create(
                model="tts-1", voice="en", input="hello", response_format="pcm") as response:
            assert response.headers["transfer-encoding"] == "chunked"
            pieces = response.iter_bytes()
            first = await anext(pieces)  # only the engine's first chunk exists yet
            assert not engine.gate.is_set() and len(first) > 0
            engine.gate.set()
            rest = b"".join([piece async for piece in pieces])
    assert len(first) + len(rest) == 2 * engine.samples_per_stream
    assert np.all(np.frombuffer(first + rest, dtype="<i2") == GatedEngine.level_of(1))


async def test_sse_sends_audio_deltas_then_done(espeak):
    async with serve(espeak) as server:
        async with client(server).audio.speech.with_streaming_response.create(
                model="tts-1", voice="en", input=TEXT, response_format="pcm", stream_format="sse") as response:
            assert response.headers["content-type"] == "text/event-stream"
            events = [json.loads(line.removeprefix("data: ")) async for line in response.iter_lines()
                      if line.startswith("data: ")]
    assert [event["type"] for event in events[-1:]] == ["speech.audio.done"]
    audio = b"".join(base64.b64decode(event["audio"]) for event in events[:-1])
    assert all(event["type"] == "speech.audio.delta" for event in events[:-1])
    assert near(len(audio) / 2, await engine_samples(espeak, TEXT))


@pytest.mark.parametrize(("arguments", "error", "param", "code", "words"), [
    ({"voice": "alloy"}, openai.BadRequestError, "voice", "unknown_voice", "unknown voice 'alloy'; known: en, zh"),
    ({"response_format": "opus"}, openai.BadRequestError, "response_format", "invalid_field",
     "choose one of mp3, wav, pcm"),
    ({"speed": 1.5}, openai.BadRequestError, "speed", "invalid_field", "only 1.0 is supported"),
    ({"input": ""}, openai.BadRequestError, "input", "empty_text", "empty"),
    ({"input": "x" * 3000}, openai.BadRequestError, "input", "text_too_long", "the limit is 2000"),
    ({"model": ""}, openai.BadRequestError, "model", "invalid_field", "must not be empty"),
])
async def test_bad_requests_raise_openais_typed_errors(espeak, arguments, error, param, code, words):
    request = {"model": "tts-1", "voice": "en", "input": TEXT, **arguments}
    async with serve(espeak) as server:
        with pytest.raises(error) as raised:
            await client(server).audio.speech.create(**request)
    assert raised.value.status_code == 400
    assert (raised.value.type, raised.value.param, raised.value.code) == ("invalid_request_error", param, code)
    assert words in raised.value.body["message"]


async def test_a_wrong_key_is_an_authentication_error(espeak):
    async with serve(espeak) as server:
        with pytest.raises(openai.AuthenticationError) as raised:
            await client(server, "not-a-key-0123456789").audio.speech.create(model="tts-1", voice="en", input=TEXT)
    assert (raised.value.status_code, raised.value.code) == (401, "invalid_api_key")
    assert raised.value.body["message"] == "the API key is not known"


async def test_a_key_past_its_streams_is_a_rate_limit_error_and_a_full_engine_a_server_error():
    engine = GatedEngine(chunks=2)
    async with serve(engine, settings(admission_timeout_s=0.2)) as server:
        async with client(server, OTHER_KEY).audio.speech.with_streaming_response.create(
                model="tts-1", voice="en", input="one", response_format="pcm") as open_stream:
            await anext(open_stream.iter_bytes())  # the key's one stream is held
            with pytest.raises(openai.RateLimitError) as limited:
                await client(server, OTHER_KEY).audio.speech.create(model="tts-1", voice="en", input="two")
            engine.gate.set()
    assert limited.value.code == "too_many_streams" and limited.value.type == "rate_limit_error"
    async with serve(GatedEngine(admit=False), settings(admission_timeout_s=0.2)) as server:
        with pytest.raises(openai.InternalServerError) as full:
            await client(server).audio.speech.create(model="tts-1", voice="en", input="three")
    assert full.value.status_code == 503 and full.value.code == "at_capacity"
    assert full.value.response.headers["retry-after"] == "1"


async def test_voices_lists_the_engines_voices(espeak):
    async with serve(espeak) as server, aiohttp.ClientSession(headers=AUTH) as session:
        async with session.get(f"{server.url}/v1/audio/voices") as response:
            listed = await response.json()
        async with session.get(f"{server.url}/v1/audio/voices", headers={"Authorization": "Bearer nope"}) as bad:
            refused = await bad.json()
    assert listed["voices"] == ["en", "zh"] and listed["default"] == "en"
    assert [voice["id"] for voice in listed["data"]] == ["en", "zh"]
    assert bad.status == 401 and refused["error"]["code"] == "invalid_api_key"

