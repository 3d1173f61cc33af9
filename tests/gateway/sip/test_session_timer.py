"""RFC 4028 negotiation as the UAS (gateway/sip/session_timer.py): what a request asks and what we agree to."""

from __future__ import annotations

import pytest

from gateway.sip.message import SipRequest
from gateway.sip.session_timer import Agreement, SessionTimerSettings, TooSmall, negotiate

SETTINGS = SessionTimerSettings(enabled=True, expires_s=1800, min_se_s=90)


def _invite(*headers: tuple[str, str]) -> SipRequest:
    return SipRequest(method="INVITE", uri="sip:1000@127.0.0.1", headers=headers)


@pytest.mark.parametrize("headers, expected", [
    # §9: the caller's refresher is kept; `timer` supported -> Require: timer in the 2xx.
    ((("Supported", "timer"), ("Session-Expires", "600;refresher=uac")), Agreement(600, "uac", True)),
    ((("k", "100rel, timer"), ("x", "600;refresher=uas")), Agreement(600, "uas", True)),  # compact forms
    # No refresher named: we take it (uas) and refresh ourselves.
    ((("Supported", "timer"), ("Session-Expires", "600")), Agreement(600, "uas", True)),
    # Without Supported: timer the UAC cannot refresh (§9): uas whatever it wrote, no Require.
    ((("Session-Expires", "600;refresher=uac"),), Agreement(600, "uas", False)),
    # No Session-Expires: ours, at least the request's Min-SE.
    ((), Agreement(1800, "uas", False)),
    ((("Supported", "timer"), ("Min-SE", "3600")), Agreement(3600, "uas", True)),
    # Below our minimum: 422 with our Min-SE (§8.1).
    ((("Session-Expires", "89"),), TooSmall(90)),
])
def test_negotiation(headers, expected):
    assert negotiate(_invite(*headers), SETTINGS) == expected


def test_headers_and_deadlines_follow_rfc_4028():
    agreement = Agreement(1800, "uac", True)
    assert agreement.response_headers() == (("Session-Expires", "1800;refresher=uac"), ("Require", "timer"))
    assert Agreement(1800, "uas", False).response_headers() == (("Session-Expires", "1800;refresher=uas"),)
    assert agreement.refresh_after_s == 900  # §10: half the interval
    assert agreement.bye_after_s == 1800 - 32  # §10: expiry - min(32, SE/3)
    assert Agreement(90, "uac", True).bye_after_s == 60
    assert TooSmall(90).response_headers() == (("Min-SE", "90"),)


def test_disabled_or_unparsable():
    assert negotiate(_invite(("Session-Expires", "600")), SessionTimerSettings(enabled=False)) is None
    with pytest.raises(ValueError, match="Session-Expires: expected delta-seconds"):
        negotiate(_invite(("Session-Expires", "soon")), SETTINGS)
