"""The worker's server over a real socket with a real aiohttp WebSocket client, on the instant engine."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest

from engine_service import protocol
from engine_service.server import WorkerSettings
from engines.instant import InstantEngine, render_test_signal, signal_seconds
from engines.ssml import Pause, Speech
from engines.ssml.segments import to_wire
from tests.engine_service.worker_link import TOKEN, connect, frame_is, serving


@pytest.fixture
async def worker():
    # instant renders far faster than real time; the first-chunk delay keeps a stream (and its slot) open a while
    engine = InstantEngine(chunk_ms=100, ms_per_char=20.0, max_duration_s=30.0, first_chunk_delay_ms=800)
    await engine.start()
    async with serving(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05)) as base:
        yield base
    await engine.close()


async def test_hello_then_open_chunks_end(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        hello = await link.until(frame_is(protocol.Hello))
        assert hello.version == protocol.VERSION and hello.engine == "instant"
        assert "en" in hello.voices and hello.sample_rate == 24000
        await link.send(protocol.Open(stream=5, text="hello there, caller, from the worker", voice="en", call_id="c5"))
        await link.until(frame_is(protocol.End, 5))
        kinds = [type(f) for f in link.frames if getattr(f, "stream", None) == 5]
        assert kinds == [protocol.Opened, protocol.End]
        audio = np.concatenate(link.audio[5])
        assert len(audio) == int(len("hello there, caller, from the worker") * 0.02 * 24000) and np.abs(audio).max() > 0.05


async def test_ssml_segments_in_an_open_are_spoken_in_order_with_the_pause_as_silence(worker):
    """What a gateway sends for an SSML prompt (engines.ssml.segments.to_wire): the worker speaks each piece with
    the engine and puts the pause between them as zeros."""
    segments = to_wire((Speech("first part"), Pause(700), Speech("second", volume_db=-6.0)))
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=3, text="first part second", voice="en", segments=segments))
        await link.until(frame_is(protocol.End, 3))
        audio = np.concatenate(link.audio[3])
    # the fixture's engine: 20 ms per character, at least 0.5 s (InstantEngine's default) per text
    first, second = (int(signal_seconds(text, 20.0, 0.5, 30.0) * 24000) for text in ("first part", "second"))
    assert len(audio) == first + 24000 * 700 // 1000 + second
    assert np.abs(audio[first:first + 16800]).max() == 0  # 700 ms of silence
    quieter = render_test_signal("second", 0, second)  # the instant engine's signal for that text, at -6 dB
    assert np.allclose(audio[-second:], quieter * 10 ** (-6 / 20), atol=1e-6)


async def test_segments_that_are_no_speech_or_pause_are_refused(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=4, text="x", voice="en", segments=[{"pause_ms": 999_999}]))
        refused = await link.until(frame_is(protocol.Refused, 4))
        assert refused.reason == "bad_text" and "segments[0]" in refused.message


async def test_s16le_audio_is_the_same_signal(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=1, text="same text", voice="en", format="f32le"))
        await link.send(protocol.Open(stream=2, text="same text", voice="en", format="s16le"))
        await link.until(frame_is(protocol.End, 1))
        await link.until(frame_is(protocol.End, 2))
        assert np.allclose(np.concatenate(link.audio[1]), np.concatenate(link.audio[2]), atol=1 / 32768)


async def test_status_heartbeat_counts_slots_and_cancel_frees_one(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=1, text="x" * 1000, voice="en"))  # 20 s of audio: stays open
        await link.until(frame_is(protocol.Opened, 1))
        link.frames.clear()
        status = await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 1)
        assert status.state == "ready" and status.slots_total == 2
        await link.send(protocol.Cancel(1))
        link.frames.clear()
        await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 2)
        assert not link.of(1, protocol.End)  # a cancelled stream gets no end


@pytest.mark.parametrize("open_frame, reason", [
    (protocol.Open(stream=9, text="hi", voice="klingon"), "unknown_voice"),
    (protocol.Open(stream=9, text="   ", voice="en"), "empty_text"),
    (protocol.Open(stream=9, text="x" * 2001, voice="en"), "too_long"),
    (protocol.Open(stream=9, text="bell \x07 here", voice="en"), "bad_text"),
    (protocol.Open(stream=9, text="hi", voice="en", sample_rate=8000), "bad_request"),
])
async def test_refusals_come_before_any_audio_with_their_reason(worker, open_frame, reason):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(open_frame)
        refused = await link.until(frame_is(protocol.Refused, 9))
        assert refused.reason == reason and refused.message
        assert 9 not in link.audio and not link.of(9, protocol.Opened)


async def test_a_full_worker_refuses_with_no_capacity(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        for stream in (1, 2, 3):
            await link.send(protocol.Open(stream=stream, text="x" * 1000, voice="en"))
        refused = await link.until(frame_is(protocol.Refused, 3))
        assert refused.reason == "no_capacity"
        assert link.of(1, protocol.Opened) or await link.until(frame_is(protocol.Opened, 1))


async def test_status_counts_the_links_own_opens_admitted_or_refused(worker):
    """What lets a gateway count free slots exactly: a status says how many of its link's opens the worker has
    handled, whatever the answer (a malformed open too: the gateway counted it as sent); another link's are not."""
    async with aiohttp.ClientSession() as session:
        link, other = await connect(session, worker), await connect(session, worker)
        for stream in (1, 2, 3):  # two admitted, the third refused: no_capacity
            await link.send(protocol.Open(stream=stream, text="x" * 1000, voice="en"))
        await link.send('{"type":"open","stream":4,"text":"hi"}')  # no voice: refused, bad_request
        await link.until(frame_is(protocol.Refused, 4))
        link.frames.clear()
        status = await link.until(frame_is(protocol.Status))  # built after the refusal left, so it counts all four
        assert (status.opens_seen, status.slots_free) == (4, 0)
        assert (await other.until(frame_is(protocol.Status))).opens_seen == 0


async def test_a_malformed_frame_gets_an_error_and_harms_no_other_stream(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=1, text="a stream that keeps going for a while", voice="en"))
        await link.until(frame_is(protocol.Opened, 1))
        await link.send("{not json")
        error = await link.until(frame_is(protocol.Error))
        assert "not JSON" in error.message
        await link.send('{"type":"open","stream":2,"text":"hi"}')  # no voice: refused, named
        refused = await link.until(frame_is(protocol.Refused, 2))
        assert refused.reason == "bad_request" and "voice" in refused.message
        await link.ws.send_bytes(b"\x00\x00\x00\x01junk")
        await link.until(lambda f: isinstance(f, protocol.Error) and "binary" in f.message)
        await link.until(frame_is(protocol.End, 1))
        assert sum(len(a) for a in link.audio[1]) == int(len("a stream that keeps going for a while") * 0.02 * 24000)


async def test_wrong_token_is_401_and_wrong_version_is_400(worker):
    async with aiohttp.ClientSession() as session:
        for headers in ({}, {"Authorization": "Bearer nope"}):
            with pytest.raises(aiohttp.WSServerHandshakeError) as caught:
                await session.ws_connect(f"{worker}{protocol.STREAM_PATH}", params={"version": str(protocol.VERSION)},
                                         headers=headers)
            assert caught.value.status == 401
        async with session.get(f"{worker}{protocol.STREAM_PATH}", params={"version": "1"},
                               headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            assert response.status == 400  # a version 1 gateway could not read our status frames
            assert "version 1 is not spoken here" in (await response.json())["error"]
        async with session.get(f"{worker}/v1/status") as response:
            assert response.status == 401
        async with session.get(f"{worker}/v1/status", headers={"Authorization": f"Bearer {TOKEN}"}) as response:
            body = await response.json()
            assert response.status == 200 and body["state"] == "ready" and body["slots_total"] == 2
        async with session.get(f"{worker}/healthz") as response:
            assert response.status == 200 and json.loads(await response.text())["state"] == "ready"


async def test_a_dropped_link_frees_its_streams_slots(worker):
    async with aiohttp.ClientSession() as session:
        first = await connect(session, worker)
        await first.send(protocol.Open(stream=1, text="x" * 1000, voice="en"))
        await first.send(protocol.Open(stream=2, text="x" * 1000, voice="en"))
        await first.until(frame_is(protocol.Opened, 2))
        await first.ws.close()
        second = await connect(session, worker)
        await second.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 2)


async def test_speech_api_streams_share_the_workers_slots_with_gateway_links():
    """The worker serves the speech API beside the link: an API stream takes a worker slot, so gateways see it
    taken and are refused when the API holds them all; when the API stream ends the slot is free again."""
    from engine_service.api.settings import TtsApiSettings

    key = "k" * 24
    engine = InstantEngine(chunk_ms=100, ms_per_char=20.0, max_duration_s=30.0, first_chunk_delay_ms=800)
    await engine.start()
    api = TtsApiSettings.from_mapping({"api_keys": [{"name": "bot", "key": key, "max_streams": 4}]})
    try:
        async with serving(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05), api) as base, \
                aiohttp.ClientSession() as session:
            async def speak() -> bytes:
                async with session.post(f"{base}/v1/tts", headers={"Authorization": f"Bearer {key}"},
                                        json={"text": "hello from the api", "format": "pcm_s16le"}) as response:
                    assert response.status == 200, await response.text()
                    return await response.read()

            api_streams = [asyncio.create_task(speak()) for _ in range(2)]
            link = await connect(session, base)
            await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 0)
            await link.send(protocol.Open(stream=1, text="hello", voice="en"))
            refused = await link.until(frame_is(protocol.Refused, 1))
            assert refused.reason == "no_capacity"
            assert all(len(audio) > 0 for audio in await asyncio.gather(*api_streams))
            await link.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 2)
            await link.ws.close()
    finally:
        await engine.close()


async def test_a_status_says_the_graphs_only_to_a_link_that_asked(worker):
    """An older gateway refuses a status with a field it does not know, so `graphs` goes only to a link opened
    with graphs=1 (what engines.remote asks); the heartbeat of a link that did not ask reads as it always did."""
    async with aiohttp.ClientSession() as session:
        raw = {}
        for asked in ("", "1"):
            params = {"version": str(protocol.VERSION), **({"graphs": asked} if asked else {})}
            async with session.ws_connect(f"{worker}{protocol.STREAM_PATH}", params=params,
                                          headers={"Authorization": f"Bearer {TOKEN}"}) as ws:
                while (frame := json.loads((await asyncio.wait_for(ws.receive(), 5)).data))["type"] != "status":
                    pass
                raw[asked] = frame
    assert "graphs" not in raw[""] and raw["1"]["graphs"] == "compiled"  # instant: nothing to compile
