"""InstantEngine: model-free, deterministic, length follows the text, chunked at 24 kHz."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from engines.base import EmptyText, SynthesisRequest, UnknownVoice
from engines.instant import InstantEngine


async def speak(engine: InstantEngine, text: str, voice: str = "en") -> list[np.ndarray]:
    return [chunk async for chunk in engine.open_stream(SynthesisRequest(text=text, voice=voice))]


@pytest.fixture
async def engine():
    engine = InstantEngine(chunk_ms=100)
    await engine.start()
    yield engine
    await engine.close()


async def test_duration_follows_text_length_in_chunks_of_the_configured_size(engine):
    chunks = await speak(engine, "x" * 50)  # 50 characters * 60 ms = 3 s
    assert sum(c.size for c in chunks) == 3 * 24_000
    assert {c.size for c in chunks[:-1]} == {2_400}
    assert all(c.dtype == np.float32 for c in chunks)


async def test_duration_is_bounded(engine):
    assert sum(c.size for c in await speak(engine, "hi")) == 12_000  # 0.5 s floor
    assert sum(c.size for c in await speak(engine, "y" * 1_000)) == 30 * 24_000  # 30 s ceiling


async def test_signal_is_speech_like_and_deterministic(engine):
    first = np.concatenate(await speak(engine, "Your balance is twelve dollars."))
    again = np.concatenate(await speak(engine, "Your balance is twelve dollars."))
    other = np.concatenate(await speak(engine, "Your balance is thirty dollars."))
    assert np.array_equal(first, again)
    assert not np.array_equal(first[: other.size], other[: first.size])
    assert 0.05 < float(np.sqrt(np.mean(first**2))) < 0.5
    # Syllable envelope: 50 ms windows range from near silence to loud.
    window_rms = np.sqrt(np.mean(first[: first.size // 1200 * 1200].reshape(-1, 1200) ** 2, axis=1))
    assert window_rms.min() < 0.2 * window_rms.max()


async def test_first_chunk_delay_is_honoured_without_serialising_streams():
    engine = InstantEngine(first_chunk_delay_ms=200)
    await engine.start()
    t0 = time.monotonic()
    await asyncio.gather(*(speak(engine, f"call {i}") for i in range(10)))
    elapsed = time.monotonic() - t0
    await engine.close()
    assert 0.2 <= elapsed < 1.5


async def test_refusals(engine):
    with pytest.raises(UnknownVoice):
        engine.open_stream(SynthesisRequest(text="hello", voice="fr"))
    with pytest.raises(EmptyText):
        engine.open_stream(SynthesisRequest(text="", voice="en"))


async def test_cancel_stops_the_stream(engine):
    channel = engine.open_stream(SynthesisRequest(text="z" * 400, voice="en"))
    channel.cancel()
    assert [chunk async for chunk in channel] == []
