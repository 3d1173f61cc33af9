"""One render per key however many ask at once; hits never render; a refused or failed render stores nothing."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from speech_audio.prompt_cache import PromptCache
from speech_audio.prompt_store import PromptKey, PromptStore

KEY = PromptKey("Press one for sales.", "en", "test", 8000, "-19.0")


class CountingRender:
    """A source that yields its chunks when released, counting how often it was asked to render."""

    def __init__(self, chunks: int = 3) -> None:
        self.renders = 0
        self.release = asyncio.Event()
        self._chunks = chunks

    async def __call__(self):
        self.renders += 1
        return self._source()

    async def _source(self):
        for i in range(self._chunks):
            await self.release.wait()
            yield np.full(160, i + 1, dtype=np.int16)


async def _all(chunks) -> np.ndarray:
    return np.concatenate([chunk async for chunk in chunks])


async def test_concurrent_misses_render_once_and_both_hear_the_whole_prompt(tmp_path):
    cache = PromptCache(PromptStore(tmp_path, 1 << 20))
    render = CountingRender()
    first, second = await asyncio.gather(cache.open(KEY, render), cache.open(KEY, render))
    assert not first.hit and not second.hit
    render.release.set()
    heard = await asyncio.gather(_all(first.chunks), _all(second.chunks))
    assert render.renders == 1
    assert cache.misses == 1 and cache.hits["in_flight"] == 1
    assert all(np.array_equal(h, np.repeat(np.arange(1, 4, dtype=np.int16), 160)) for h in heard)
    await cache.close()


async def test_after_the_fill_a_hit_is_the_whole_prompt_and_a_new_cache_reads_it_from_disk(tmp_path):
    cache = PromptCache(PromptStore(tmp_path, 1 << 20))
    render = CountingRender()
    render.release.set()
    await _all((await cache.open(KEY, render)).chunks)
    await asyncio.gather(*cache._tasks)  # the file is written
    hit = await cache.open(KEY, render)
    assert hit.hit and hit.samples.size == 480
    restarted = PromptCache(PromptStore(tmp_path, 1 << 20))
    again = await restarted.open(KEY, render)
    assert again.hit and restarted.hits["disk"] == 1
    assert render.renders == 1


async def test_a_refused_render_refuses_its_joiners_and_the_next_caller_renders_again(tmp_path):
    cache = PromptCache(PromptStore(tmp_path, 1 << 20))
    gate = asyncio.Event()

    async def refused():
        await gate.wait()
        raise LookupError("no engine slot")

    first = asyncio.ensure_future(cache.open(KEY, refused))
    second = asyncio.ensure_future(cache.open(KEY, refused))
    await asyncio.sleep(0)
    gate.set()
    for task in (first, second):
        with pytest.raises(LookupError):
            await task
    render = CountingRender()
    render.release.set()
    assert not (await cache.open(KEY, render)).hit and render.renders == 1
    await cache.close()


async def test_a_render_failing_midway_fails_its_listeners_and_keeps_nothing(tmp_path):
    cache = PromptCache(PromptStore(tmp_path, 1 << 20))

    async def broken():
        async def source():
            yield np.ones(160, dtype=np.int16)
            raise RuntimeError("engine died")
        return source()

    audio = await cache.open(KEY, broken)
    with pytest.raises(RuntimeError, match="engine died"):
        await _all(audio.chunks)
    assert cache.fill_failures == 1
    assert await cache.lookup(KEY) is None


async def test_the_counts_are_served_as_prometheus_families_under_the_process_prefix(tmp_path):
    from prometheus_client import CollectorRegistry, generate_latest

    from speech_audio.cache_metrics import PromptCacheCollector

    cache = PromptCache(PromptStore(tmp_path, 1 << 20))
    render = CountingRender()
    render.release.set()
    await _all((await cache.open(KEY, render)).chunks)
    await cache.open(KEY, render)
    registry = CollectorRegistry()
    collector = PromptCacheCollector("tts_api_prompt_cache")
    collector.cache = cache
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'tts_api_prompt_cache_hits_total{where="memory"} 1.0' in text
    assert "tts_api_prompt_cache_misses_total 1.0" in text
    assert 'tts_api_prompt_cache_bytes{tier="memory"} 960.0' in text
    await cache.close()
