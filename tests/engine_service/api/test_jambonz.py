"""jambonz's custom TTS vendor API, replayed message by message as jambonz sends it, over real sockets."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from engine_service.api.context import TTS_API
from tests.engine_service.api.api_server import AUTH, OTHER_KEY, GatedEngine, serve, settings, until

pytestmark = pytest.mark.timeout(60)

JAMBONZ_HEADERS = {**AUTH, "Content-Type": "application/json", "Accept": "audio/mpeg"}  # as mod_custom_tts sends


async def test_http_vendor_answers_l16_at_8k_streamed(espeak):
    body = {"language": "en-US", "voice": "en", "type": "text", "text": "Your call is important to us."}
    async with serve(espeak) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/jambonz/tts", json=body, headers=JAMBONZ_HEADERS) as response:
            assert response.status == 200
            assert response.headers["Content-Type"] == "audio/l16;rate=8000"
            pcm = np.frombuffer(await response.read(), dtype="<i2")
    assert 8000 * 1.0 < len(pcm) < 8000 * 4.0  # a short sentence at 8 kHz
    assert np.abs(pcm.astype(np.int32)).max() > 3000


async def test_http_vendor_speaks_ssml_with_its_break_as_silence_and_uses_the_configured_rate():
    engine = GatedEngine(chunks=1)  # 100 ms of a constant level per piece of speech
    body = {"language": "en-US", "voice": "en", "type": "ssml",
            "text": '<speak>Press <emphasis>one</emphasis><break time="300ms"/>now.</speak>'}
    async with serve(engine, settings(jambonz_sample_rate=16000)) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/jambonz/tts", json=body, headers=JAMBONZ_HEADERS) as response:
            assert response.headers["Content-Type"] == "audio/l16;rate=16000"
            pcm = np.frombuffer(await response.read(), dtype="<i2")
    assert engine.texts == ["Press one", "now."]
    assert abs(len(pcm) - 16 * 500) <= 8  # 100 ms, the 300 ms break, 100 ms
    silent = np.flatnonzero(np.abs(pcm[1600:-1600].astype(np.int32)) < 30)
    assert len(silent) >= 16 * 290


async def test_http_vendor_refuses_malformed_ssml_with_400_json():
    engine = GatedEngine(chunks=1)
    body = {"voice": "en", "type": "ssml", "text": "<speak>Press <break time='300ms'>one</speak>"}
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/jambonz/tts", json=body, headers=JAMBONZ_HEADERS) as response:
            assert response.status == 400
            answer = await response.json()
    assert answer["error"] == "bad_ssml" and "not well-formed" in answer["message"]
    assert engine.texts == []


async def test_http_vendor_picks_the_voice_from_the_language_when_the_voice_is_not_given():
    engine = GatedEngine(chunks=1)
    body = {"language": "zh-CN", "type": "text", "text": "你好"}
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/jambonz/tts", json=body, headers=JAMBONZ_HEADERS) as response:
            assert response.status == 200
            await response.read()
        async with client.post(f"{server.url}/v1/jambonz/tts", json={**body, "voice": "en-GB-Wavenet"},
                               headers=JAMBONZ_HEADERS) as response:
            assert response.status == 400 and (await response.json())["error"] == "unknown_voice"


@pytest.mark.parametrize(("headers", "status"), [({}, 401), ({"Authorization": "Bearer wrong-key-000000000000"}, 401)])
async def test_http_vendor_refuses_without_the_key(espeak, headers, status):
    async with serve(espeak) as server, aiohttp.ClientSession() as client:
        async with client.post(f"{server.url}/v1/jambonz/tts", json={"text": "hi"}, headers=headers) as response:
            assert response.status == status


async def receive_audio_until_closed(ws: aiohttp.ClientWebSocketResponse) -> tuple[bytes, list[dict]]:
    audio, messages = b"", []
    async for message in ws:
        if message.type == aiohttp.WSMsgType.BINARY:
            audio += message.data
        elif message.type == aiohttp.WSMsgType.TEXT:
            messages.append(message.json())
    return audio, messages


async def test_websocket_contract_connect_stream_flush_stop():
    engine = GatedEngine(chunks=3)
    engine.gate.set()
    per_sentence = 3 * 800  # three 100 ms chunks at 8 kHz
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/jambonz/ws?voice=en&language=en-US&sampleRate=8000",
                                     headers=AUTH) as ws:
            assert await ws.receive_json() == {"type": "connect",
                                               "data": {"sample_rate": 8000, "base64_encoding": False}}
            for piece in ["Hello", " there.", " How are", " you today?"]:  # an LLM's tokens, as jambonz relays them
                await ws.send_json({"type": "stream", "text": piece})
            await ws.send_json({"type": "flush"})
            audio = b""
            while len(audio) < 2 * 2 * per_sentence - 32:
                message = await ws.receive(timeout=5)
                assert message.type == aiohttp.WSMsgType.BINARY
                audio += message.data
            await ws.send_json({"type": "stop"})
            rest, messages = await receive_audio_until_closed(ws)
    pcm = np.frombuffer(audio + rest, dtype="<i2")
    assert engine.texts == ["Hello there.", "How are you today?"]
    assert abs(len(pcm) - 2 * per_sentence) <= 16 and messages == []
    middle_of_first, middle_of_second = pcm[per_sentence // 2], pcm[per_sentence + per_sentence // 2]
    assert abs(middle_of_first - GatedEngine.level_of(1)) < 200  # sentence order kept
    assert abs(middle_of_second - GatedEngine.level_of(2)) < 200


async def test_websocket_stop_ends_the_session_and_cancels_the_engine_stream():
    engine = GatedEngine(chunks=50)
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        slots = server.app[TTS_API].slots
        async with client.ws_connect(f"{server.ws_url}/v1/jambonz/ws?voice=en&sampleRate=16000",
                                     headers={"Authorization": f"Bearer {OTHER_KEY}"}) as ws:
            assert (await ws.receive_json())["data"]["sample_rate"] == 16000
            await ws.send_json({"type": "stream", "text": "A long answer"})
            await ws.send_json({"type": "flush"})
            assert (await ws.receive(timeout=5)).type == aiohttp.WSMsgType.BINARY
            assert slots.in_use("other") == 1
            await ws.send_json({"type": "stop"})
            await receive_audio_until_closed(ws)
        await until(lambda: slots.in_use("other") == 0)
        assert engine.channels[0].cancelled


async def test_websocket_survives_bad_and_unknown_messages():
    engine = GatedEngine(chunks=1)
    engine.gate.set()
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/jambonz/ws?voice=en&sampleRate=8000", headers=AUTH) as ws:
            await ws.receive_json()
            await ws.send_str("{not json")
            error = await ws.receive_json(timeout=5)
            assert error["type"] == "error" and error["error"].startswith("bad_json")
            await ws.send_json({"type": "keepalive"})
            await ws.send_json({"type": "stream", "text": "Still here."})
            await ws.send_json({"type": "flush"})
            assert (await ws.receive(timeout=5)).type == aiohttp.WSMsgType.BINARY


async def test_websocket_handshake_needs_the_key_and_a_known_voice(espeak):
    async with serve(espeak) as server, aiohttp.ClientSession() as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(f"{server.ws_url}/v1/jambonz/ws?voice=en&sampleRate=8000")
        assert caught.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(f"{server.ws_url}/v1/jambonz/ws?voice=nope&sampleRate=8000", headers=AUTH)
        assert caught.value.status == 400
