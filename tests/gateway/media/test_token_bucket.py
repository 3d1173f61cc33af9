"""The token bucket behind the per-call DTMF limit, on explicit times."""

from __future__ import annotations

from gateway.media.token_bucket import TokenBucket


def test_a_burst_passes_then_one_event_per_refilled_token() -> None:
    bucket = TokenBucket(rate_per_s=2, burst=3, now=100.0)
    assert [bucket.take(100.0) for _ in range(5)] == [True, True, True, False, False]
    assert bucket.take(100.25) is False  # half a token
    assert bucket.take(100.5) is True
    assert bucket.take(100.5) is False
    # A long quiet spell refills only up to the burst.
    assert [bucket.take(200.0) for _ in range(4)] == [True, True, True, False]
