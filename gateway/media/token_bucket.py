"""A token bucket: at most `rate_per_s` events per second on average, `burst` at once.

Pure arithmetic on times the caller passes in (no clock of its own), so it is exact to test.
"""

from __future__ import annotations


class TokenBucket:
    def __init__(self, rate_per_s: float, burst: float, now: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError("rate_per_s must be > 0 and burst >= 1")
        self._rate = rate_per_s
        self._burst = burst
        self._tokens = burst
        self._at = now

    def take(self, now: float) -> bool:
        """Spend one token if there is one; False means the event is over the limit."""
        self._tokens = min(self._burst, self._tokens + (now - self._at) * self._rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
