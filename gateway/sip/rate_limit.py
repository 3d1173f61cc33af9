"""Per-source request budgets, checked before a message is parsed (the idea of Kamailio's pike module).

A flood from one address must cost the gateway as little as possible and never the packet clock of
live calls: each source IP has a token bucket refilled at `rate` per second holding at most
`burst`; a message that finds it empty is shed. A second, smaller bucket decides whether the shed
request still gets a cheap 503 (so an honest peer backs off, RFC 3261 §21.5.4) or is dropped
silently (so the flood cannot make us amplify it). Episodes are reported once when they start and
once when they end, never one log line per request.

Pure: the caller passes the time; no sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAX_SOURCES = 4096  # sources tracked at once; the oldest full bucket is forgotten first
_REPLIES_PER_S = 10.0  # 503s a second per flooding source; the rest are dropped


@dataclass
class _Bucket:
    tokens: float
    replies: float
    updated: float
    shed: int = 0  # requests shed in the current episode


@dataclass(frozen=True)
class Verdict:
    """Admit one message, or shed it (`episode_started` on the first shed of an episode)."""

    admit: bool
    episode_started: bool = False


ADMIT = Verdict(True)


class SourceRateLimiter:
    def __init__(self, rate_per_s: float, burst: float | None = None) -> None:
        self.rate = rate_per_s
        self.burst = burst if burst is not None else 2 * rate_per_s
        self._buckets: dict[str, _Bucket] = {}

    def check(self, source: str, now: float) -> Verdict:
        bucket = self._buckets.get(source)
        if bucket is None:
            if len(self._buckets) >= _MAX_SOURCES:
                self._forget_one()
            bucket = self._buckets[source] = _Bucket(self.burst, _REPLIES_PER_S, now)
        elapsed = max(0.0, now - bucket.updated)
        bucket.updated = now
        bucket.tokens = min(self.burst, bucket.tokens + elapsed * self.rate)
        bucket.replies = min(_REPLIES_PER_S, bucket.replies + elapsed * _REPLIES_PER_S)
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return ADMIT
        bucket.shed += 1
        return Verdict(False, episode_started=bucket.shed == 1)

    def take_reply(self, source: str) -> bool:
        """Whether a shed request from `source` (just checked) may still get its cheap 503."""
        bucket = self._buckets.get(source)
        if bucket is None or bucket.replies < 1.0:
            return False
        bucket.replies -= 1.0
        return True

    def finished_episodes(self, now: float) -> list[tuple[str, int]]:
        """Sources whose bucket refilled since they were last shed: (source, requests shed). Each
        episode is returned once; full, quiet buckets are forgotten to keep the table small."""
        ended = []
        for source, bucket in list(self._buckets.items()):
            tokens = min(self.burst, bucket.tokens + max(0.0, now - bucket.updated) * self.rate)
            if tokens >= self.burst:
                if bucket.shed:
                    ended.append((source, bucket.shed))
                del self._buckets[source]
        return ended

    def _forget_one(self) -> None:
        victim = next((s for s, b in self._buckets.items() if b.shed == 0), next(iter(self._buckets)))
        del self._buckets[victim]
