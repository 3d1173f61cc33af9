"""The flood budgets, with the time passed in: per-source bucket, refill, cheap-503 share, episodes; junk,
total, live-call and stranger budgets (FloodGuard); bounded, forgotten state."""

from __future__ import annotations

from gateway.sip.rate_limit import ALL_SOURCES, FloodGuard, FloodLimits, SourceRateLimiter


def test_burst_then_rate_then_refill():
    limiter = SourceRateLimiter(rate_per_s=10)  # burst 20
    verdicts = [limiter.check("192.0.2.1", 0.0) for _ in range(30)]
    assert sum(v.admit for v in verdicts) == 20
    assert [v.episode_started for v in verdicts].count(True) == 1 and verdicts[20].episode_started
    assert limiter.check("198.51.100.1", 0.0).admit  # another source has its own budget
    assert sum(limiter.check("192.0.2.1", 0.5).admit for _ in range(10)) == 5  # 0.5 s refills 5


def test_shed_requests_get_a_bounded_number_of_503s():
    limiter = SourceRateLimiter(rate_per_s=1, burst=1)
    limiter.check("192.0.2.1", 0.0)
    shed = [limiter.check("192.0.2.1", 0.0) for _ in range(1000)]
    assert not any(v.admit for v in shed)
    assert sum(limiter.take_reply("192.0.2.1") for _ in shed) == 10  # the rest are dropped: no amplifier
    assert limiter.take_reply("192.0.2.1") is False
    assert limiter.check("192.0.2.1", 1.0).admit and not limiter.check("192.0.2.1", 1.0).admit
    assert limiter.take_reply("192.0.2.1")  # a second later the 503 budget has refilled too


def test_episode_is_reported_once_when_the_bucket_refills():
    limiter = SourceRateLimiter(rate_per_s=10)
    for _ in range(25):
        limiter.check("192.0.2.1", 0.0)
    assert limiter.finished_episodes(1.0) == []  # 10 of 20 tokens back: still in the episode
    assert limiter.finished_episodes(2.5) == [("192.0.2.1", 5)]
    assert limiter.finished_episodes(3.0) == []
    assert limiter.check("192.0.2.1", 3.0).admit


def test_table_of_sources_is_bounded():
    limiter = SourceRateLimiter(rate_per_s=1)
    for i in range(10_000):
        limiter.check(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}", 0.0)
    assert len(limiter._buckets) <= 4096


def test_junk_has_its_own_budget_and_the_total_bounds_many_sources():
    guard = FloodGuard(FloodLimits(per_source_per_s=10, total_per_s=30, junk_per_source_per_s=5, junk_total_per_s=5))
    assert sum(guard.check("192.0.2.1", 0.0, junk=True).admit for _ in range(100)) == 10  # junk burst: 10
    assert sum(guard.check("192.0.2.1", 0.0).admit for _ in range(20)) == 20  # the source's requests: untouched
    admitted = sum(guard.check(f"198.51.100.{i}", 0.0).admit for i in range(100))
    assert admitted == 40  # the total's burst (60) less the 20 above: many sources cannot buy more
    shed = guard.check("203.0.113.1", 0.0)
    assert not shed.admit and shed.source == ALL_SOURCES


def test_live_calls_have_their_own_budget_and_503s_are_bounded_in_total():
    guard = FloodGuard(FloodLimits(per_source_per_s=1, total_per_s=1))
    assert sum(guard.admit_in_dialog("call-1", 0.0) for _ in range(100)) == 40  # 20 a second, burst 40
    for i in range(200):
        guard.check(f"192.0.2.{i}", 0.0)
    assert sum(guard.take_reply(f"192.0.2.{i}") for i in range(200)) == 50  # not 10 per source
    assert sum(guard.take_stranger_reply(0.0) for _ in range(100)) == 10


def test_a_batch_over_budget_spends_what_is_left():
    limiter = SourceRateLimiter(rate_per_s=10)  # burst 20
    assert not limiter.check("192.0.2.1", 0.0, cost=1000).admit  # 1,000 keep-alives in one read
    assert not limiter.check("192.0.2.1", 0.0).admit  # nothing left: a reconnect is refused too
    assert limiter.check("192.0.2.1", 0.1).admit


def test_flood_state_is_forgotten_once_quiet():
    guard = FloodGuard(FloodLimits())
    for i in range(5000):
        guard.check(f"10.0.{i >> 8}.{i & 255}", 0.0, junk=i % 2 == 0)
        guard.admit_in_dialog(f"call-{i}", 0.0)
    assert len(guard._requests.sources._buckets) <= 4096
    # each source within its own budget; together over the totals: one episode each, reported once
    assert guard.finished_episodes(60.0) == [(ALL_SOURCES, 2500 - 2 * 500), (ALL_SOURCES, 2500 - 2 * 100)]
    assert guard.finished_episodes(61.0) == []
    assert all(not budget.sources._buckets for budget in (guard._requests, guard._junk))
    assert not guard._calls._buckets
