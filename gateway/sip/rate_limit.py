"""Request budgets, checked before a message is parsed (the idea of Kamailio's pike module).

A flood must cost the gateway as little as possible and never the packet clock of live calls. UDP
source addresses are not authenticated, so no budget may be one a spoofer can spend for someone else:

- requests that look like SIP (and TCP keep-alives) have a token bucket per source IP and one for all
  sources together: many sources at once cannot buy more work than one loop can do between packets;
- junk (what does not even start like a SIP message) has its own per-source and total buckets, so
  garbage carrying a trunk's address cannot spend the trunk's budget for real requests;
- requests of a live call (its Call-ID, found without parsing) pass even when their source or the total
  is over budget, limited only per call: a BYE or ACK of a call in progress is never shed by a flood;
- strangers (outside the allow-list) are not parsed: a few cheap 403s a second in total, the rest dropped.

A shed request still gets a cheap 503 from a second, small bucket (per source and in total), so an honest
peer backs off (RFC 3261 §21.5.4) while the flood cannot make us amplify it. Episodes are reported once
when they start and once when they end, never one log line per request. Memory is bounded: at most
`_MAX_SOURCES` sources are tracked per kind and full, quiet buckets are forgotten.

Pure: the caller passes the time; no sockets, no clocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MAX_SOURCES = 4096  # sources tracked at once per kind; the oldest full bucket is forgotten first
_REPLIES_PER_S = 10.0  # 503s a second per flooding source; the rest are dropped
_TOTAL_REPLIES_PER_S = 50.0  # 503s a second across all sources (a spoofer may use any number of them)
_STRANGER_REPLIES_PER_S = 10.0  # cheap 403s a second to sources outside the allow-list, all together
_IN_DIALOG_PER_S = 20.0  # requests a second per live call (re-INVITE, INFO, BYE and their retransmissions)
ALL_SOURCES = "*"  # the `source` of an episode of the total budget

# What a SIP message starts with (§7.1: Request-Line or Status-Line), checked on the first bytes only.
# Lenient on purpose: a malformed but SIP-shaped request still counts as a request and gets its 400.
_SIP_START = re.compile(rb"(?:[!-~]{1,32} [^\r\n]{1,2000} SIP/|SIP/\d)")
_CALL_ID = re.compile(rb"\r\n(?:call-id|i)[ \t]*:[ \t]*([^\r\n]+?)[ \t]*\r\n", re.IGNORECASE)


def looks_like_sip(data: bytes) -> bool:
    return _SIP_START.match(data, 0, 2048) is not None


def raw_call_id(data: bytes) -> str | None:
    """The Call-ID as written in the header block (§20.8, compact form `i`), without parsing the message."""
    match = _CALL_ID.search(data, 0, 8192)
    return match.group(1).decode("latin-1") if match is not None else None


@dataclass(frozen=True)
class FloodLimits:
    """Requests a second (bursts of twice these pass). sip.flood in the config; validated there."""

    per_source_per_s: float = 100.0
    total_per_s: float = 500.0  # all sources together: what the loop does beside the packet clock
    junk_per_source_per_s: float = 10.0
    junk_total_per_s: float = 100.0


class _Bucket:
    __slots__ = ("tokens", "replies", "updated", "shed")

    def __init__(self, tokens: float, replies: float, now: float) -> None:
        self.tokens, self.replies, self.updated, self.shed = tokens, replies, now, 0

    def refill(self, now: float, rate: float, burst: float, reply_rate: float) -> None:
        elapsed = max(0.0, now - self.updated)
        self.updated = now
        self.tokens = min(burst, self.tokens + elapsed * rate)
        self.replies = min(reply_rate, self.replies + elapsed * reply_rate)

    def take(self, cost: float) -> bool:
        if self.tokens >= cost:
            self.tokens -= cost
            return True
        if cost > 1:  # a batch over budget (keep-alives in one read) spends what is left
            self.tokens = 0.0
        self.shed += 1
        return False


@dataclass(frozen=True)
class Verdict:
    """Admit one message, or shed it: `episode_started` on the first shed of an episode, `source` whose
    budget shed it (the source IP, or ALL_SOURCES for the total)."""

    admit: bool
    episode_started: bool = False
    source: str = ""


ADMIT = Verdict(True)


class SourceRateLimiter:
    """A token bucket per key (source IP, or Call-ID for live calls), refilled at `rate` a second up to
    `burst`, with a reply bucket beside it (`reply_rate` a second)."""

    def __init__(self, rate_per_s: float, burst: float | None = None, reply_rate: float = _REPLIES_PER_S) -> None:
        self.rate = rate_per_s
        self.burst = burst if burst is not None else 2 * rate_per_s
        self._reply_rate = reply_rate
        self._buckets: dict[str, _Bucket] = {}

    def check(self, source: str, now: float, cost: float = 1.0) -> Verdict:
        bucket = self._buckets.get(source)
        if bucket is None:
            if len(self._buckets) >= _MAX_SOURCES:
                self._forget_one()
            bucket = self._buckets[source] = _Bucket(self.burst, self._reply_rate, now)
        bucket.refill(now, self.rate, self.burst, self._reply_rate)
        if bucket.take(cost):
            return ADMIT
        return Verdict(False, episode_started=bucket.shed == 1, source=source)

    def take_reply(self, source: str) -> bool:
        """Whether a shed request from `source` (just checked) may still get its cheap answer."""
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

    def forget(self, source: str) -> None:
        self._buckets.pop(source, None)

    def _forget_one(self) -> None:
        victim = next((s for s, b in self._buckets.items() if b.shed == 0), next(iter(self._buckets)))
        del self._buckets[victim]


class _Budget:
    """One kind of traffic (requests or junk): a bucket per source and one for all sources together."""

    def __init__(self, per_source_per_s: float, total_per_s: float) -> None:
        self.sources = SourceRateLimiter(per_source_per_s)
        self.total = SourceRateLimiter(total_per_s, reply_rate=_TOTAL_REPLIES_PER_S)

    def check(self, source: str, now: float, cost: float) -> Verdict:
        verdict = self.sources.check(source, now, cost)
        return verdict if not verdict.admit else self.total.check(ALL_SOURCES, now, cost)

    def take_reply(self, source: str) -> bool:
        # The source's share first: one flooder with none left must not spend the total's for others.
        return self.sources.take_reply(source) and self.total.take_reply(ALL_SOURCES)

    def finished_episodes(self, now: float) -> list[tuple[str, int]]:
        return self.sources.finished_episodes(now) + self.total.finished_episodes(now)


class FloodGuard:
    """Every budget the SIP edge checks before parsing; see the module docstring for which is which."""

    def __init__(self, limits: FloodLimits) -> None:
        self.limits = limits
        self._requests = _Budget(limits.per_source_per_s, limits.total_per_s)
        self._junk = _Budget(limits.junk_per_source_per_s, limits.junk_total_per_s)
        self._calls = SourceRateLimiter(_IN_DIALOG_PER_S)
        self._strangers = SourceRateLimiter(_STRANGER_REPLIES_PER_S, burst=_STRANGER_REPLIES_PER_S)

    def check(self, source: str, now: float, *, junk: bool = False, cost: float = 1.0) -> Verdict:
        return (self._junk if junk else self._requests).check(source, now, cost)

    def admit_in_dialog(self, call_id: str, now: float) -> bool:
        return self._calls.check(call_id, now).admit

    def call_ended(self, call_id: str) -> None:
        self._calls.forget(call_id)

    def take_reply(self, source: str, *, junk: bool = False) -> bool:
        """Whether a shed message from `source` (just checked) may still get its cheap 503."""
        return (self._junk if junk else self._requests).take_reply(source)

    def take_stranger_reply(self, now: float) -> bool:
        """Whether a request from outside the allow-list may get its cheap 403 (all strangers together)."""
        return self._strangers.check(ALL_SOURCES, now).admit

    def finished_episodes(self, now: float) -> list[tuple[str, int]]:
        self._calls.finished_episodes(now)  # forgets full buckets; a live call's episodes are not floods
        self._strangers.finished_episodes(now)
        return self._requests.finished_episodes(now) + self._junk.finished_episodes(now)
