"""What a flood leaves in the logs: at most `per_s` lines a second, the rest counted and summed into one
`sip_log_suppressed` line when the second rolls over. The events it guards are the ones a peer can
repeat at will (malformed messages, refused INVITEs); metrics count every one of them regardless.
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
