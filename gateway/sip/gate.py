"""The SIP server's gate before parsing: whether a received message is parsed at all (issue #31).

In order: a source outside the allow-list gets a few cheap 403s and the rest is dropped (requests of a
live call excepted: whether they are still welcome is decided after parsing, against their dialog); then the budgets of
rate_limit.py (junk, per source, all sources together) shed with a few cheap 503s, the rest dropped,
never a 503 to a retransmission of a transaction being served, and never shedding a request of a live
call (found by its raw Call-ID). Every check reads raw bytes, so a flood costs a dict lookup or two
and, at most, a cheap answer sent to the source address only.

Owns the index of live calls' Call-IDs and the flood episode log lines; gateway/sip/uas.py tells it
when calls start and end and hands it every message first.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import structlog

from gateway import metrics
from gateway.sip.edge_replies import cheap_reply
from gateway.sip.log_budget import OncePerSource
from gateway.sip.rate_limit import (
    ALL_SOURCES,
    FloodGuard,
    FloodLimits,
    Verdict,
    looks_like_sip,
    raw_call_id,
)
from gateway.sip.transport import Peer

log = structlog.get_logger(__name__)

_BRANCH = re.compile(rb";\s*branch\s*=\s*(z9hG4bK[^;,\s]*)", re.IGNORECASE)  # the first is the top Via's
_NEVER_ANSWERED = (b"SIP/", b"ACK ")  # responses and ACKs get no response (§17.1.1.3)
_LOG_SOURCE_CHARS = 64
REFUSAL_LOG_INTERVAL_S = 60.0  # a refused source is named in the log once per this


class PreParseGate:
    def __init__(self, limits: FloodLimits, retry_after_s: int, allowed: Callable[[str], bool],
                 has_branch: Callable[[str], bool], send: Callable[[bytes, Peer], None]) -> None:
        self._limits = limits
        self._retry_after_s = retry_after_s
        self._allowed = allowed
        self._has_branch = has_branch
        self._send = send
        self._flood = FloodGuard(limits)
        self._live_call_ids: dict[str, int] = {}  # Call-ID -> dialogs with it
        self._refusals_logged = OncePerSource(REFUSAL_LOG_INTERVAL_S)

    def admit(self, data: bytes, peer: Peer) -> bool:
        """Whether `data` is parsed; if not, it has been answered cheaply or dropped, and counted."""
        source, now = peer.address[0], time.monotonic()
        if not self._allowed(source) and not self._of_live_call(data, now):
            self._refuse_stranger(data, peer, now)
            return False
        junk = not looks_like_sip(data)
        verdict = self._flood.check(source, now, junk=junk)
        if not verdict.admit and (junk or not self._of_live_call(data, now)):
            self._shed(data, peer, verdict, junk)
            return False
        return True

    def within_budget(self, source: str, cost: int) -> bool:
        """TCP keep-alives (RFC 5626 §3.5.1) and new connections cost a request each from the source's budget."""
        verdict = self._flood.check(source, time.monotonic(), cost=cost)
        if not verdict.admit:
            metrics.sip_shed_total.labels(budget="tcp").inc()
        return verdict.admit

    def call_started(self, call_id: str) -> None:
        self._live_call_ids[call_id] = self._live_call_ids.get(call_id, 0) + 1

    def call_ended(self, call_id: str) -> None:
        left = self._live_call_ids.pop(call_id, 1) - 1
        if left:
            self._live_call_ids[call_id] = left
        else:
            self._flood.call_ended(call_id)

    def sweep(self) -> None:
        """Once a second: report flood episodes that ended and forget quiet sources."""
        now = time.monotonic()
        for source, shed in self._flood.finished_episodes(now):
            log.warning("sip_flood_ended", source=_short(source), requests_shed=shed)
        if unnamed := self._refusals_logged.sweep(now):
            log.warning("sip_source_refused_unnamed", sources=unnamed, why="too many sources to name each")

    def _of_live_call(self, data: bytes, now: float) -> bool:
        """A request of a call in progress (by its raw Call-ID, within that call's own budget). Its tags
        are checked after parsing (481 when they name no dialog)."""
        call_id = raw_call_id(data) if self._live_call_ids else None
        return call_id in self._live_call_ids and self._flood.admit_in_dialog(call_id, now)

    def _refuse_stranger(self, data: bytes, peer: Peer, now: float) -> None:
        """Outside the allow-list: a few cheap 403s a second in total (so a misconfigured PBX learns why);
        the rest dropped (no amplifier, no help to a scanner). The operator is told once a minute per source:
        a PBX missing from the trunks is the first thing a new install meets."""
        metrics.sip_dropped_total.labels(reason="not_allowed").inc()
        self._log_refused(peer.address[0], _first_word(data), now)
        if looks_like_sip(data) and not data.startswith(_NEVER_ANSWERED) and self._flood.take_stranger_reply(now):
            self._cheap_reply(data, peer, 403, "Forbidden")

    def connection_refused(self, source: str) -> None:
        """A TCP connection from outside the allow-list, closed at accept (transport.py): named like a request."""
        self._log_refused(source, "TCP connection", time.monotonic())

    def _log_refused(self, source: str, what: str, now: float) -> None:
        if self._refusals_logged.due(source, now):
            log.warning("sip_source_refused", source=_short(source), reason="not_in_trunks", what=what,
                        fix="add the address to trunks[].allow (sip_config/gateway.yaml)",
                        next_in_s=REFUSAL_LOG_INTERVAL_S)

    def _shed(self, data: bytes, peer: Peer, verdict: Verdict, junk: bool) -> None:
        budget = ("junk" if junk else "requests") + ("_total" if verdict.source == ALL_SOURCES else "")
        metrics.sip_shed_total.labels(budget=budget).inc()
        if verdict.episode_started:
            limits = self._limits
            limit = {"requests": limits.per_source_per_s, "requests_total": limits.total_per_s,
                     "junk": limits.junk_per_source_per_s, "junk_total": limits.junk_total_per_s}[budget]
            log.warning("sip_flood_started", source=_short(verdict.source), budget=budget, limit_per_s=limit)
        if (not junk and not data.startswith(_NEVER_ANSWERED) and not self._is_retransmission(data)
                and self._flood.take_reply(peer.address[0])):
            metrics.sip_rate_limited_total.labels(action="503").inc()
            self._cheap_reply(data, peer, 503, "Service Unavailable")
        else:  # a dropped retransmission is harmless; a 503 to it would end a live transaction
            metrics.sip_rate_limited_total.labels(action="dropped").inc()

    def _is_retransmission(self, data: bytes) -> bool:
        match = _BRANCH.search(data, 0, 4096)
        return match is not None and self._has_branch(match.group(1).decode("latin-1"))

    def _cheap_reply(self, data: bytes, peer: Peer, status: int, reason: str) -> None:
        """An answer without parsing or a transaction (503: §21.5.4), to the source address only."""
        extra = (f"Retry-After: {self._retry_after_s}",) if status == 503 else ()
        response = cheap_reply(data, status, reason, extra)
        if response is not None:
            metrics.sip_responses_total.labels(code=str(status)).inc()
            self._send(response, peer)


def _first_word(data: bytes) -> str:
    """The method (or "SIP/2.0" for a response), printable and short: what the refused source sent."""
    word = data[:16].split(b" ", 1)[0]
    return word.decode("ascii", "replace") if word.isalnum() or word == b"SIP/2.0" else "junk"


def _short(source: str) -> str:
    return source if len(source) <= _LOG_SOURCE_CHARS else source[:_LOG_SOURCE_CHARS] + "..."
