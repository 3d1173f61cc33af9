"""The running session timer of one confirmed dialog (RFC 4028 §10): the refresh we send when we are the
refresher, and the BYE when the session expires unrefreshed. The numbers come from session_timer.py;
this module only holds the two timer handles and reacts to the refresh's outcome. It sends nothing
itself: `send_refresh` (a re-INVITE or UPDATE, built by inbound_call.py) and `expire` (our BYE) are given.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import replace
from typing import Any

import structlog

from gateway.sip.message import SipResponse
from gateway.sip.session_timer import Agreement

log = structlog.get_logger(__name__)

SendRefresh = Callable[[Agreement], Awaitable[SipResponse | None]]


class SessionRefresh:
    def __init__(self, agreement: Agreement, send_refresh: SendRefresh, expire: Callable[[], None],
                 spawn: Callable[[Coroutine[Any, Any, None]], None], call_id: str) -> None:
        self.agreement = agreement
        self._send_refresh = send_refresh
        self._expire = expire
        self._spawn = spawn
        self._loop = asyncio.get_running_loop()
        self._refresh: asyncio.TimerHandle | None = None
        self._expiry: asyncio.TimerHandle | None = None
        self._log = log.bind(call_id=call_id)
        self._stopped = False
        self.restart(agreement)

    def restart(self, agreement: Agreement) -> None:
        """A refresh succeeded (or the session began) under `agreement`: both timers start again (§10)."""
        if self._stopped:
            return
        self.agreement = agreement
        self._cancel()
        self._expiry = self._loop.call_later(agreement.bye_after_s, self._on_expiry)
        if agreement.we_refresh:
            self._schedule_refresh(agreement.refresh_after_s)

    def stop(self) -> None:
        self._stopped = True
        self._cancel()

    def _cancel(self) -> None:
        for handle in (self._refresh, self._expiry):
            if handle is not None:
                handle.cancel()
        self._refresh = self._expiry = None

    def _schedule_refresh(self, delay: float) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        self._refresh = self._loop.call_later(delay, lambda: self._spawn(self._refresh_now()))

    def _on_expiry(self) -> None:
        self._expiry = None
        self._log.warning("session_timer_expired", interval_s=self.agreement.interval_s,
                          refresher=self.agreement.refresher)
        self.stop()
        self._expire()

    async def _refresh_now(self) -> None:
        self._refresh = None
        agreement = self.agreement
        response = await self._send_refresh(agreement)
        if self._stopped:
            return
        status = response.status if response is not None else None
        self._log.info("session_refresh_sent", status=status, interval_s=agreement.interval_s)
        if status is not None and 200 <= status < 300:
            self.restart(agreement)
        elif status == 422 and response is not None:
            # §7.4 (via §7.3): try again at once with the Min-SE the peer asks for.
            min_se = (response.header("Min-SE") or "").split(";", 1)[0].strip()
            if min_se.isdigit() and int(min_se) > agreement.interval_s:
                self.agreement = replace(agreement, interval_s=int(min_se))
                self._schedule_refresh(0)
        elif status == 491:
            self._schedule_refresh(random.uniform(0, 2))  # RFC 3261 §14.1: not the Call-ID's owner
        elif status in (None, 408, 481):
            # RFC 3261 §12.2.1.2: no answer, 408 or 481 ends the dialog.
            self.stop()
            self._expire()
        # Any other failure leaves the session unrefreshed: the expiry timer ends it (§10).
