"""Session timers (RFC 4028) as the UAS of a dialog: what a request asks, what we agree to, and when
the refresh and the BYE are due. Pure: no sockets, no clocks; gateway/sip/session_refresh.py runs the
timers this module computes.

- A request's `Session-Expires` (compact `x`) below our minimum gets 422 with our `Min-SE` (§8.1).
- The agreed interval is the request's Session-Expires, or ours when it names none (§9); the refresher
  is the one the request names, else `uas`: we refresh ourselves, so a vanished peer is found by our own
  refresh failing, whatever the peer implements. A UAC that does not list `timer` in Supported can only
  get `refresher=uas` (§9), and then no `Require: timer` goes back (§9).
- The refresher sends its refresh at half the interval (§10); the other side sends BYE at
  expiry - min(32 s, interval / 3) when no refresh came (§10).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.sip.message import SipRequest

Refresher = Literal["uac", "uas"]


@dataclass(frozen=True)
class SessionTimerSettings:
    enabled: bool = True
    expires_s: int = 1800  # what we ask for when the request names no Session-Expires (§4: 1800 s recommended)
    min_se_s: int = 90  # the smallest interval we accept (§4: MUST NOT be under 90 s on the wire)


@dataclass(frozen=True)
class Agreement:
    """A session timer in force: its interval, who refreshes, and whether the UAC understands `timer`."""

    interval_s: int
    refresher: Refresher
    uac_supports: bool

    @property
    def we_refresh(self) -> bool:
        return self.refresher == "uas"

    def response_headers(self) -> tuple[tuple[str, str], ...]:
        """The 2xx's Session-Expires, and `Require: timer` when the UAC understands it (§9)."""
        headers: tuple[tuple[str, str], ...] = (("Session-Expires", f"{self.interval_s};refresher={self.refresher}"),)
        return (*headers, ("Require", "timer")) if self.uac_supports else headers

    def request_headers(self, min_se_s: int) -> tuple[tuple[str, str], ...]:
        """Our refresh request's Session-Expires (we keep the refresher role, §7.4), Min-SE and Supported."""
        return (("Session-Expires", f"{self.interval_s};refresher=uas"), ("Min-SE", str(min_se_s)),
                ("Supported", "timer"))

    @property
    def refresh_after_s(self) -> float:
        """§10: the refresher sends its refresh at half the interval."""
        return self.interval_s / 2

    @property
    def bye_after_s(self) -> float:
        """§10: without a refresh, BYE at expiry minus min(32 s, one third of the interval)."""
        return self.interval_s - min(32.0, self.interval_s / 3)


@dataclass(frozen=True)
class TooSmall:
    """The request's Session-Expires is below our minimum: answer 422 with this Min-SE (§8.1)."""

    min_se_s: int

    def response_headers(self) -> tuple[tuple[str, str], ...]:
        return (("Min-SE", str(self.min_se_s)),)


def negotiate(request: SipRequest, settings: SessionTimerSettings) -> Agreement | TooSmall | None:
    """What a dialog-creating or refreshing request and our settings agree to; None: no session timer.
    Raises ValueError for a Session-Expires or Min-SE that does not parse (the caller answers 400)."""
    if not settings.enabled:
        return None
    uac_supports = "timer" in supported_options(request)
    asked = request.header("Session-Expires")
    min_se = max(settings.min_se_s, _delta_seconds(request.header("Min-SE"), "Min-SE") or 0)
    if asked is None:
        # §9: we may still use the timer; without the UAC's support only as the refresher ourselves.
        return Agreement(max(settings.expires_s, min_se), "uas", uac_supports)
    value, _, params = asked.partition(";")
    interval = _delta_seconds(value, "Session-Expires")
    assert interval is not None
    if interval < settings.min_se_s:
        return TooSmall(settings.min_se_s)
    refresher = _refresher(params)
    if refresher is None or not uac_supports:
        refresher = "uas"
    return Agreement(interval, refresher, uac_supports)


def supported_options(request: SipRequest) -> set[str]:
    return {item.strip().lower() for line in request.header_lines("Supported") for item in line.split(",")
            if item.strip()}


def _delta_seconds(value: str | None, name: str) -> int | None:
    if value is None:
        return None
    text = value.split(";", 1)[0].strip()
    if not text.isdigit() or len(text) > 10:
        raise ValueError(f"{name}: expected delta-seconds, got {value[:40]!r}")
    return int(text)


def _refresher(params: str) -> Refresher | None:
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "refresher" and value.strip().lower() in ("uac", "uas"):
            return value.strip().lower()  # type: ignore[return-value]
    return None
