"""The synthesizer's header fields (RFC 6787 §8.4): which are refused (403), which values are illegal (404)."""

from __future__ import annotations

import pytest

from gateway.mrcp.message import Headers, MessageError
from gateway.mrcp.params import check_names, ignored_names, rate_multiplier, settable_values


def test_known_fields_pass_and_unknown_ones_are_named():
    check_names(1, Headers((("Voice-Age", "28"), ("Logging-Tag", "x"), ("voice-name", "en"))))
    with pytest.raises(MessageError) as caught:
        check_names(1, Headers((("Voice-Name", "en"), ("X-Bogus", "1"))))
    assert caught.value.status == 403 and "X-Bogus" in caught.value.reason


@pytest.mark.parametrize(("name", "value"), [
    ("Kill-On-Barge-In", "maybe"), ("Speech-Language", "en_US!"), ("Prosody-Rate", "warp"),
    ("Prosody-Rate", "0.1"), ("Prosody-Rate", "-1"), ("Voice-Name", ""),
])
def test_illegal_values_get_404_naming_the_field(name, value):
    with pytest.raises(MessageError) as caught:
        settable_values(3, Headers(((name, value),)))
    assert (caught.value.status, caught.value.request_id) == (404, 3)
    assert caught.value.reason.startswith(name)


def test_settable_values_and_ignored_names():
    headers = Headers((("voice-name", "zh"), ("Kill-On-Barge-In", "FALSE"), ("Voice-Gender", "female"),
                       ("Speech-Marker", "timestamp=1")))
    assert settable_values(1, headers) == {"Voice-Name": "zh", "Kill-On-Barge-In": "false"}
    assert ignored_names(headers) == ["Voice-Gender", "Speech-Marker"]


def test_prosody_rate_is_a_multiplier():
    assert [rate_multiplier(v) for v in ("x-slow", "medium", "default", "FAST", "1.5", "2")] == \
        [0.5, 1.0, 1.0, 1.25, 1.5, 2.0]
