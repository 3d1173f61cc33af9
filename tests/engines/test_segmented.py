"""SSML segments spoken on real engines (engines/segmented.py): pieces in order, pauses as zeros, volume as gain,
prosody rate where the engine honours it (eSpeak NG), a refusal before any audio, cancel reaching the piece."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from engines.base import SynthesisRequest, UnknownVoice
from engines.instant import InstantEngine, render_test_signal
from engines.segmented import speech_request


@pytest.fixture
async def instant():
    engine = InstantEngine(ms_per_char=20.0, min_duration_s=0.1)
    await engine.start()
    yield engine
    await engine.close()


async def heard(engine, request: SynthesisRequest) -> np.ndarray:
    channel = engine.open_stream(request)
    await channel.admitted()
    return np.concatenate([chunk async for chunk in channel])


async def test_pieces_in_order_with_the_pause_as_zeros_and_the_volume_as_gain(instant):
    request = speech_request('<speak>first<break time="250ms"/><prosody volume="-6dB">second</prosody></speak>',
                             "en")
    audio = await heard(instant, request)
    first = render_test_signal("first", 0, 2400)  # 5 characters at 20 ms, at 24 kHz
    second = render_test_signal("second", 0, 2880)
    assert len(audio) == 2400 + 6000 + 2880
    assert np.array_equal(audio[:2400], first)
    assert not audio[2400:8400].any()
    assert np.allclose(audio[8400:], second * 10 ** (-6 / 20), atol=1e-7)


@pytest.mark.parametrize("voice", ["en", "zh"])
async def test_espeak_speaks_a_slow_prosody_slower(espeak, voice):
    words = {"en": "Please hold the line while we connect your call.", "zh": "请稍候，我们正在为您转接。"}[voice]
    normal = await heard(espeak, speech_request(f"<speak>{words}</speak>", voice))
    slow = await heard(espeak, speech_request(f'<speak><prosody rate="x-slow">{words}</prosody></speak>', voice))
    assert 1.5 < len(slow) / len(normal) < 2.5  # half the words per minute


async def test_an_ssml_request_is_validated_whole_before_any_piece(instant):
    request = speech_request('<speak><break time="100ms"/>hello</speak>', "klingon")
    with pytest.raises(UnknownVoice):
        instant.open_stream(request)  # the whole request is validated first, as for plain text


async def test_cancel_stops_the_piece_being_spoken(espeak):
    request = speech_request("<speak>" + "Thank you for calling. " * 40 + '<break time="1s"/>bye</speak>', "en")
    channel = espeak.open_stream(request)
    await channel.admitted()
    await anext(channel)
    piece = channel.piece
    channel.cancel()
    assert piece is not None and piece.cancelled
    await asyncio.sleep(0)
    assert channel.task is not None and (channel.task.done() or channel.task.cancelling())
