"""What refusals and floods leave in the log (gateway/sip/log_budget.py): pure, on a clock the test sets."""

from __future__ import annotations

from gateway.sip.log_budget import OncePerSource


def test_a_source_is_named_once_per_interval_however_often_it_is_refused():
    once = OncePerSource(interval_s=60.0)
    assert [once.due("192.0.2.7", 100.0 + i * 0.01) for i in range(500)] == [True] + [False] * 499
    assert once.due("192.0.2.8", 105.0)  # another source has its own line
    once.sweep(130.0)
    assert not once.due("192.0.2.7", 159.9)
    once.sweep(160.0)
    assert once.due("192.0.2.7", 160.0)  # the next interval: named again


def test_a_scan_from_many_sources_names_a_bounded_number_and_counts_the_rest():
    once = OncePerSource(interval_s=60.0, max_sources=3)
    named = [once.due(f"198.51.100.{i}", 1.0) for i in range(10)]
    assert named == [True] * 3 + [False] * 7
    assert once.sweep(2.0) == 7 and once.sweep(3.0) == 0
    once.sweep(61.0)  # their interval over, forgotten: room for new sources
    assert once.due("198.51.100.9", 61.5)
