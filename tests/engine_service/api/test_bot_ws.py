"""The bot WebSocket (/v1/tts/ws): LLM text in pieces, audio per sentence in order, flush, and clear (barge-in)."""

from __future__ import annotations

import aiohttp
import numpy as np
import pytest

from engine_service.api.context import TTS_API
from tests.engine_service.api.api_server import AUTH, OTHER_KEY, GatedEngine, serve, settings, until

pytestmark = pytest.mark.timeout(60)


async def next_event(ws: aiohttp.ClientWebSocketResponse) -> tuple[str, object]:
    """('audio', bytes) or (message type, message)."""
    message = await ws.receive(timeout=10)
    if message.type == aiohttp.WSMsgType.BINARY:
        return "audio", message.data
    assert message.type == aiohttp.WSMsgType.TEXT, message
    body = message.json()
    return body["type"], body


async def test_llm_tokens_become_sentences_spoken_in_order_with_a_mark_at_each_end(espeak):
    tokens = ["Sure", ",", " I", " can", " help", ".", " What", " time", " suits", " you", "?", " We", " open", " at"]
    async with serve(espeak) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws?voice=en&format=pcm_s16le&sample_rate=16000",
                                     headers=AUTH) as ws:
            assert (await next_event(ws))[1] == {"type": "ready", "voice": "en", "format": "pcm_s16le",
                                                 "sample_rate": 16000}
            for token in tokens:
                await ws.send_json({"type": "text", "text": token})
            await ws.send_json({"type": "text", "text": " nine."})
            await ws.send_json({"type": "flush"})
            ends, audio = [], b""
            while len(ends) < 3:
                kind, event = await next_event(ws)
                if kind == "audio":
                    audio += event
                else:
                    assert kind == "sentence_end", event
                    assert event["audio_bytes"] == len(audio) and len(audio) > 16000  # at least 0.5 s each
                    ends.append(event)
                    audio = b""
    assert [(end["index"], end["text"]) for end in ends] == [
        (0, "Sure, I can help."), (1, "What time suits you?"), (2, "We open at nine.")]


async def test_clear_stops_the_audio_at_once_and_the_next_text_speaks_fresh():
    engine = GatedEngine(chunks=20)
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws?voice=en", headers=AUTH) as ws:
            await next_event(ws)
            await ws.send_json({"type": "text", "text": "First sentence here. Second sentence queued. Third"})
            kind, _ = await next_event(ws)
            assert kind == "audio"  # sentence 0 is speaking, the engine holds the rest of it
            await ws.send_json({"type": "clear"})
            kind, _ = await next_event(ws)
            assert kind == "cleared"  # the first chunk came before the clear; nothing after it
            engine.gate.set()  # the engine could go on now: the API must not pass any of it on
            await ws.send_json({"type": "text", "text": "After the clear."})
            await ws.send_json({"type": "flush"})
            audio = b""
            while (event := await next_event(ws))[0] == "audio":
                audio += event[1]
            kind, end = event
    assert kind == "sentence_end" and (end["index"], end["text"]) == (2, "After the clear.")
    pcm = np.frombuffer(audio, dtype="<i2")
    assert len(pcm) == engine.samples_per_stream  # the new sentence's audio, all of it
    assert np.all(np.abs(pcm - GatedEngine.level_of(2)) < 200)  # and none of the cleared stream's
    assert engine.texts == ["First sentence here.", "After the clear."]  # the queued sentence was never spoken
    assert engine.channels[0].cancelled


async def test_a_bad_sentence_is_reported_by_index_and_the_stream_goes_on():
    engine = GatedEngine(chunks=1)
    async with serve(engine) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=AUTH) as ws:
            await next_event(ws)
            await ws.send_str("not json")
            kind, error = await next_event(ws)
            assert (kind, error["error"]) == ("error", "bad_json")
            await ws.send_json({"type": "shout", "text": "hi"})
            kind, error = await next_event(ws)
            assert (kind, error["error"]) == ("error", "invalid_field")
            await ws.send_json({"type": "text", "text": "Ring \u0007 the bell. Then speak."})
            await ws.send_json({"type": "flush"})
            kind, error = await next_event(ws)
            assert (kind, error["error"], error["index"]) == ("error", "bad_text", 0)
            assert (await next_event(ws))[0] == "audio"
            kind, end = await next_event(ws)
            assert (kind, end["index"], end["text"]) == ("sentence_end", 1, "Then speak.")


async def test_too_much_text_without_a_sentence_end_is_refused_and_dropped():
    engine = GatedEngine(chunks=1)
    async with serve(engine, settings(max_text_chars=50)) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=AUTH) as ws:
            await next_event(ws)
            await ws.send_json({"type": "text", "text": "x" * 51})
            kind, error = await next_event(ws)
            assert (kind, error["error"]) == ("error", "text_too_long")


@pytest.mark.parametrize(("query", "headers", "status"), [
    ("voice=en", {}, 401),
    ("voice=nope", AUTH, 400),
    ("format=wav", AUTH, 400),
    ("format=pcmu&sample_rate=16000", AUTH, 400),
    ("sample_rate=abc", AUTH, 400),
])
async def test_handshake_refusals(query, headers, status):
    async with serve(GatedEngine()) as server, aiohttp.ClientSession() as client:
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(f"{server.ws_url}/v1/tts/ws?{query}", headers=headers)
        assert caught.value.status == status


async def test_an_open_socket_holds_a_slot_until_it_closes():
    other = {"Authorization": f"Bearer {OTHER_KEY}"}  # max_streams: 1
    async with serve(GatedEngine()) as server, aiohttp.ClientSession() as client:
        slots = server.app[TTS_API].slots
        ws = await client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=other)
        await next_event(ws)
        with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
            await client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=other)
        assert caught.value.status == 429
        await ws.close()
        await until(lambda: slots.in_use("other") == 0)
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=other) as again:
            assert (await next_event(again))[0] == "ready"


async def test_a_flood_of_unspoken_text_is_refused_not_queued_without_end():
    engine = GatedEngine(chunks=50)  # the first sentence never finishes: everything after it waits
    async with serve(engine, settings(max_text_chars=50)) as server, aiohttp.ClientSession() as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws", headers=AUTH) as ws:
            await next_event(ws)
            for _ in range(16):  # 16 x 37 characters against the 500 (10 x 50) a socket may queue
                await ws.send_json({"type": "text", "text": "A sentence of some forty characters. "})
            while (event := await next_event(ws))[0] == "audio":
                pass
            kind, error = event
            assert (kind, error["error"]) == ("error", "too_much_queued")
