"""What the UAS core lends every call (`UasServices`): its identity, its timers and the few operations a dialog
needs from the server that owns the transports and the transaction table (RFC 3261 §17).

The contract between uas.py, which builds one, and inbound_call.py, which uses it; it lets inbound_call.py run a
dialog without importing uas.py. Values and callables only: nothing here sends or schedules.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gateway.sip.message import SipRequest, SipResponse
from gateway.sip.session_timer import SessionTimerSettings
from gateway.sip.transaction import InviteClientTransaction, Timers
from gateway.sip.transport import Peer

if TYPE_CHECKING:
    from gateway.sip.inbound_call import InboundCall


@dataclass(frozen=True)
class UasServices:
    """What the UAS core lends every call: its identity, its timers and the few operations a
    dialog needs from the server that owns the transports and transaction table."""

    user_agent: str
    retry_after_s: int
    timers: Timers
    contact_address: Callable[[Peer], tuple[str, int]]  # (host, port) we take requests at, per peer
    # A request inside the dialog (our BYE) -> its final response, None on timeout (§17.1.2).
    send_request: Callable[[SipRequest, str, str, int, Peer], Awaitable[SipResponse | None]]
    # Our re-INVITE inside the dialog (a session refresh) -> its started client transaction (§17.1.1).
    send_invite: Callable[[SipRequest, str, str, int, Peer], Awaitable[InviteClientTransaction]]
    spawn: Callable[[Coroutine[Any, Any, None]], None]  # a task the server cancels when it stops
    forget: Callable[[InboundCall], None]  # the dialog is over: in-dialog requests now get 481
    session_timers: SessionTimerSettings = SessionTimerSettings()
