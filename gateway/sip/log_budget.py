"""What a flood leaves in the logs: at most `per_s` lines a second, the rest counted and summed into one
`sip_log_suppressed` line when the second rolls over; and a refused source's line at most once per interval
(`OncePerSource`). The events it guards are the ones a peer can repeat at will (malformed messages, refused
INVITEs, a source outside the trunks); metrics count every one of them regardless.
"""

from __future__ import annotations

from typing import Any


class LogBudget:
    def __init__(self, logger: Any, per_s: int = 10) -> None:
        self._log = logger
        self._per_s = per_s
        self._spent = 0
        self._suppressed: dict[str, int] = {}

    def info(self, event: str, **fields: object) -> None:
        if self._spent < self._per_s:
            self._spent += 1
            self._log.info(event, **fields)
        else:
            self._suppressed[event] = self._suppressed.get(event, 0) + 1

    def roll(self) -> None:
        """A new second: the budget refills and what was held back is reported in one line."""
        self._spent = 0
        if self._suppressed:
            self._log.info("sip_log_suppressed", events=self._suppressed)
            self._suppressed = {}


class OncePerSource:
    """Whether to log about a source now: once per `interval_s` each, for at most `max_sources` sources in an
    interval (a scan from many addresses logs that many lines; the rest are counted, `sweep` returns the count)."""

    def __init__(self, interval_s: float = 60.0, max_sources: int = 256) -> None:
        self._interval_s = interval_s
        self._max_sources = max_sources
        self._logged_at: dict[str, float] = {}
        self._suppressed = 0

    def due(self, source: str, now: float) -> bool:
        last = self._logged_at.get(source)
        if last is not None and now - last < self._interval_s:
            return False
        if last is None and len(self._logged_at) >= self._max_sources:
            self._suppressed += 1
            return False
        self._logged_at[source] = now
        return True

    def sweep(self, now: float) -> int:
        """Forget sources whose interval is over; returns how many lines were held back since the last sweep."""
        self._logged_at = {source: at for source, at in self._logged_at.items() if now - at < self._interval_s}
        suppressed, self._suppressed = self._suppressed, 0
        return suppressed
