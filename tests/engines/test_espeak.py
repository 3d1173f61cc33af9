"""EspeakEngine: real libespeak-ng from the wheel, English and Mandarin, streamed at 24 kHz."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import engines.espeak as espeak_module
from engines.base import EmptyText, EngineSettingsError, SynthesisRequest, UnknownVoice
from engines.channel import ChunkChannel
from engines.espeak import EspeakEngine

LONG_EN = ("Thank you for calling. Your call is important to us. Please stay on the line and an agent "
           "will be with you shortly. Calls may be recorded for quality and training purposes.")


@pytest.fixture
def engine(espeak):  # tests/conftest.py
    return espeak


async def collect(channel: ChunkChannel) -> list[np.ndarray]:
    return [chunk async for chunk in channel]


def rms(audio: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(audio, dtype=np.float64))))


async def test_speaks_english_as_streamed_24khz_float32(engine):
    chunks = await collect(engine.open_stream(SynthesisRequest(text=LONG_EN, voice="en")))
    assert engine.sample_rate == 24_000
    assert len(chunks) > 1, "a long sentence must arrive as several chunks, not one utterance"
    assert all(chunk.dtype == np.float32 and chunk.ndim == 1 for chunk in chunks)
    audio = np.concatenate(chunks)
    seconds = audio.size / 24_000
    assert 6.0 < seconds < 25.0, f"{len(LONG_EN.split())} words took {seconds:.1f} s"
    assert rms(audio) > 0.02
    assert np.max(np.abs(audio)) <= 1.0


async def test_speaks_mandarin(engine):
    audio = np.concatenate(await collect(engine.open_stream(
        SynthesisRequest(text="您好，欢迎致电客服中心，请稍候。", voice="zh"))))
    assert 1.0 < audio.size / 24_000 < 10.0
    assert rms(audio) > 0.02


async def test_voices_and_default_come_from_settings():
    engine = EspeakEngine(voices={"english": "en-gb", "mandarin": "cmn"}, default_voice="mandarin")
    assert set(engine.voices()) == {"english", "mandarin"}
    assert engine.default_voice == "mandarin"


async def test_refuses_unknown_voice_and_empty_text(engine):
    with pytest.raises(UnknownVoice):
        engine.open_stream(SynthesisRequest(text="hello", voice="klingon"))
    with pytest.raises(EmptyText):
        engine.open_stream(SynthesisRequest(text="   ", voice="en"))


async def test_start_fails_clearly_for_a_voice_espeak_lacks():
    engine = EspeakEngine(voices={"en": "no-such-voice"})
    with pytest.raises(EngineSettingsError, match=r"engine.espeak.voices.en: 'no-such-voice'"):
        await engine.start()


async def test_cancel_stops_synthesis_early(engine, monkeypatch):
    puts: dict[int, int] = {}

    class CountingChannel(ChunkChannel):
        def put(self, chunk: np.ndarray) -> None:
            puts[id(self)] = puts.get(id(self), 0) + 1
            super().put(chunk)

    monkeypatch.setattr(espeak_module, "ChunkChannel", CountingChannel)
    text = " ".join([LONG_EN] * 8)
    full = engine.open_stream(SynthesisRequest(text=text, voice="en"))
    await collect(full)
    cancelled = engine.open_stream(SynthesisRequest(text=text, voice="en"))
    await anext(cancelled)
    cancelled.cancel()
    # The worker is serial: once the next stream is done, the cancelled one has returned.
    await collect(engine.open_stream(SynthesisRequest(text="done", voice="en")))
    assert puts[id(cancelled)] < puts[id(full)] / 4


async def test_open_stream_after_close_is_refused():
    engine = EspeakEngine()
    await engine.start()
    await engine.close()
    with pytest.raises(RuntimeError, match="start"):
        engine.open_stream(SynthesisRequest(text="hello", voice="en"))


async def test_two_engines_in_one_process_take_turns_and_restart():
    first, second = EspeakEngine(), EspeakEngine(voices={"zh": "cmn"}, default_voice="zh")
    await first.start()
    await second.start()
    english, chinese = await asyncio.gather(
        collect(first.open_stream(SynthesisRequest(text=LONG_EN, voice="en"))),
        collect(second.open_stream(SynthesisRequest(text="欢迎致电，请稍候。", voice="zh"))))
    assert len(english) > 1 and len(chinese) > 1
    await first.close()
    await first.start()
    assert len(await collect(first.open_stream(SynthesisRequest(text="again", voice="en")))) >= 1
    await first.close()
    await second.close()


async def test_a_short_prompt_is_not_kept_waiting_behind_long_ones(engine):
    """Five 2,000-character prompts are queued first; the short one behind them starts speaking before any of
    them has finished (the worker speaks every job a piece at a time, in turn), and all of them complete."""
    long_text = (LONG_EN + " ") * 12
    events: list[tuple[str, str]] = []

    async def follow(name: str, channel: ChunkChannel) -> int:
        samples = 0
        async for chunk in channel:
            if samples == 0:
                events.append(("first", name))
            samples += len(chunk)
        events.append(("end", name))
        return samples

    longs = [engine.open_stream(SynthesisRequest(text=long_text[:2000], voice="en")) for _ in range(5)]
    short = engine.open_stream(SynthesisRequest(text="Hello there.", voice="en"))
    lengths = await asyncio.gather(*(follow(f"long{i}", c) for i, c in enumerate(longs)), follow("short", short))
    short_first = events.index(("first", "short"))
    assert all(events.index(("end", f"long{i}")) > short_first for i in range(5)), events
    assert min(lengths[:5]) > 10 * lengths[5]  # the long prompts were spoken whole, not cut


def test_pieces_cut_at_sentence_ends_and_join_back_to_the_text():
    text = "First sentence. Second one! 第三句。" + "word " * 100
    pieces = espeak_module.speaking_pieces(text, limit=60)
    assert "".join(pieces) == text
    assert all(len(piece) <= 60 for piece in pieces)
    assert pieces[0].endswith("。") or pieces[0].endswith("!")  # whole sentences while they fit
