"""The per-source token bucket, with the time passed in: budget, refill, cheap-503 share, episodes."""

from __future__ import annotations

from gateway.sip.rate_limit import SourceRateLimiter


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
