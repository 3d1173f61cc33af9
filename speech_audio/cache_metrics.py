"""The prompt cache's Prometheus families, read at scrape time, under a prefix each process's metrics module names
(gateway/metrics.py: `gateway_prompt_cache`; engine_service/metrics.py: `tts_api_prompt_cache`), so both report the
same figures the same way."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from speech_audio.prompt_cache import PromptCache


class PromptCacheCollector:
    """Register once per registry; `cache` is whichever cache the process runs now (None: nothing reported)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.cache: PromptCache | None = None

    def describe(self) -> list:
        return []

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        cache, p = self.cache, self.prefix
        if cache is None:
            return
        stats = cache.store.stats()
        hits = CounterMetricFamily(f"{p}_hits", "Prompts played without rendering, by where the audio was "
                                   "(memory, disk, in_flight: joined a render another request started)", labels=["where"])
        for where, count in cache.hits.items():
            hits.add_metric([where], count)
        yield hits
        yield CounterMetricFamily(f"{p}_misses", "Prompts rendered by the engine into the cache", value=cache.misses)
        yield CounterMetricFamily(f"{p}_fill_failures", "Renders into the cache that failed midway",
                                  value=cache.fill_failures)
        yield CounterMetricFamily(f"{p}_corrupt_files", "Cache files found damaged (checksum, length, header), "
                                  "deleted and rendered again", value=stats.corrupt)
        evictions = CounterMetricFamily(f"{p}_evictions", "Entries dropped for room, by tier", labels=["tier"])
        size = GaugeMetricFamily(f"{p}_bytes", "Bytes of audio kept, by tier", labels=["tier"])
        entries = GaugeMetricFamily(f"{p}_entries", "Prompts kept, by tier", labels=["tier"])
        for tier in ("memory", "disk"):
            evictions.add_metric([tier], getattr(stats, f"{tier}_evictions"))
            size.add_metric([tier], getattr(stats, f"{tier}_bytes"))
            entries.add_metric([tier], getattr(stats, f"{tier}_entries"))
        yield from (evictions, size, entries)
