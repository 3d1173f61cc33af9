"""Operators see the cyclic GC's pauses (a full collection holds every call's packets) on /metrics."""

from __future__ import annotations

import gc

from gateway import gc_pauses, metrics


def _full_collections() -> float:
    return metrics.registry.get_sample_value("gateway_gc_pause_seconds_count", {"generation": "2"}) or 0.0


def test_each_full_collection_is_timed_once_however_often_watch_is_called():
    gc_pauses.watch()
    gc_pauses.watch()
    before = _full_collections()
    gc.collect()
    assert _full_collections() == before + 1
