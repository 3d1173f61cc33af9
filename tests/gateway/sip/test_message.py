"""SIP message parsing and serialisation: byte-exact vectors in the spirit of RFC 4475."""

from __future__ import annotations

import pytest

from gateway.sip.header_values import NameAddr, SipUri, Via
from gateway.sip.message import (
    ParseError,
    SipRequest,
    SipResponse,
    make_response,
    parse,
)

INVITE = (
    b"INVITE sip:+15551234@gw.example.com;user=phone SIP/2.0\r\n"
    b"Via: SIP/2.0/UDP 192.0.2.10:5060;branch=z9hG4bK776asdhds;rport\r\n"
    b"Via: SIP/2.0/TCP proxy.example.com;branch=z9hG4bK-p1\r\n"
    b"Max-Forwards: 69\r\n"
    b"Record-Route: <sip:proxy.example.com;lr>\r\n"
    b'From: "Alice" <sip:alice@example.com>;tag=1928301774\r\n'
    b"To: <sip:+15551234@gw.example.com>\r\n"
    b"Call-ID: a84b4c76e66710@pc33.example.com\r\n"
    b"CSeq: 314159 INVITE\r\n"
    b"Contact: <sip:alice@192.0.2.10:5060>\r\n"
    + "X-TTS-Text: Grüß Gott, 你好, 1,2,3\r\n".encode()
    + b"Content-Type: application/sdp\r\n"
    b"Content-Length: 10\r\n"
    b"\r\n"
    b"v=0\r\ns=-\r\n"
)


def test_canonical_invite_round_trips_byte_for_byte():
    message = parse(INVITE)
    assert isinstance(message, SipRequest)
    assert message.serialize() == INVITE
    assert parse(message.serialize()) == message


def test_request_fields():
    message = parse(INVITE)
    assert isinstance(message, SipRequest)
    assert (message.method, message.uri) == ("INVITE", "sip:+15551234@gw.example.com;user=phone")
    assert message.request_user == "+15551234"
    assert message.call_id == "a84b4c76e66710@pc33.example.com"
    assert message.cseq == (314159, "INVITE")
    assert message.from_tag == "1928301774" and message.to_tag is None
    assert message.body == b"v=0\r\ns=-\r\n"
    # UTF-8 header text with commas comes back whole: a non-list header is never split.
    assert message.header("x-tts-text") == "Grüß Gott, 你好, 1,2,3"


def test_header_names_are_case_insensitive_and_compact_forms_expand():
    data = (
        b"OPTIONS sip:gw.example.com SIP/2.0\r\n"
        b"v: SIP/2.0/UDP 192.0.2.1;branch=z9hG4bKc1\r\n"
        b"f: <sip:a@example.com>;tag=x1\r\n"
        b"t: <sip:gw.example.com>\r\n"
        b"i: compact-1@example.com\r\n"
        b"cSeQ: 7 OPTIONS\r\n"
        b"m: <sip:a@192.0.2.1>\r\n"
        b"k: timer\r\n"
        b"s: hello\r\n"
        b"o: presence\r\n"
        b"c: text/plain\r\n"
        b"l: 0\r\n\r\n"
    )
    message = parse(data)
    assert message.header("Call-ID") == "compact-1@example.com"
    assert message.header("CALL-id") == "compact-1@example.com"
    assert message.header("Supported") == "timer"
    assert message.header("Subject") == "hello" and message.header("Event") == "presence"
    assert message.header("Content-Type") == "text/plain" and message.header("CONTACT") == "<sip:a@192.0.2.1>"
    assert message.vias[0].branch == "z9hG4bKc1"
    assert message.serialize() == data  # names stay as written


def test_folded_lines_and_odd_whitespace():
    data = (
        b"INVITE sip:1000@gw.example.com SIP/2.0\r\n"
        b"TO :\r\n sip:1000@gw.example.com ;   tag    = 1918181833n\r\n"
        b'from   : "J \\"R\\"" <sip:j@example.com>\r\n  ;\r\n  tag = 98asjd8\r\n'
        b"MaX-fOrWaRdS: 0068\r\n"
        b"Call-ID: ws.1@192.0.2.1\r\n"
        b"cseq: 0009\r\n  INVITE\r\n"
        b"Via  : SIP  /   2.0\r\n /UDP\r\n    192.0.2.2;branch=z9hG4bK390skdjuw\r\n"
        b"v:  SIP  / 2.0  / TCP     spindle.example.com   ;\r\n  branch  =   z9hG4bK9ikj8  ,\r\n"
        b" SIP  /    2.0   / UDP  192.168.255.111   ; branch=\r\n z9hG4bK30239\r\n"
        b"NewFangled:   value\r\n\tcontinued value\r\n"
        b"Odd: ;;,,;;,;\r\n"
        b"Content-Length   : 0\r\n\r\n"
    )
    message = parse(data)
    assert message.to_tag == "1918181833n" and message.from_tag == "98asjd8"
    assert message.cseq == (9, "INVITE")
    assert [(v.transport, v.host, v.branch) for v in message.vias] == [
        ("UDP", "192.0.2.2", "z9hG4bK390skdjuw"),
        ("TCP", "spindle.example.com", "z9hG4bK9ikj8"),
        ("UDP", "192.168.255.111", "z9hG4bK30239"),
    ]
    assert message.header("newfangled") == "value continued value"


def test_multiple_via_lines_and_comma_lists_keep_order():
    data = INVITE.replace(
        b"Via: SIP/2.0/TCP proxy.example.com;branch=z9hG4bK-p1\r\n",
        b"Via: SIP/2.0/TCP proxy.example.com;branch=z9hG4bK-p1, SIP/2.0/UDP [2001:db8::9]:5070;branch=z9hG4bK-p2\r\n",
    )
    vias = parse(data).vias
    assert [v.sent_by for v in vias] == ["192.0.2.10:5060", "proxy.example.com", "[2001:db8::9]:5070"]
    assert vias[2].host == "2001:db8::9" and vias[2].port == 5070


def test_response_parses_status_and_tags():
    data = (
        b"SIP/2.0 486 Busy Here\r\n"
        b"Via: SIP/2.0/UDP 192.0.2.4;branch=z9hG4bKnashds8;received=192.0.2.99\r\n"
        b"From: <sip:bob@example.com>;tag=a6c85cf\r\nTo: <sip:alice@example.com>;tag=x9\r\n"
        b"Call-ID: r1@example.com\r\nCSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
    )
    message = parse(data)
    assert isinstance(message, SipResponse)
    assert (message.status, message.reason, message.to_tag) == (486, "Busy Here", "x9")
    assert message.vias[0].param("received") == "192.0.2.99"
    assert message.serialize() == data


def test_udp_body_longer_than_content_length_is_cut():
    message = parse(INVITE + b"trailing garbage")
    assert message.body == b"v=0\r\ns=-\r\n"


def test_udp_without_content_length_takes_the_datagram_but_tcp_needs_it():
    data = INVITE.replace(b"Content-Length: 10\r\n", b"")
    assert parse(data).body == b"v=0\r\ns=-\r\n"
    with pytest.raises(ParseError, match="Content-Length required"):
        parse(data, stream=True)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda d: d.replace(b"Content-Length: 10", b"Content-Length: 9999"), "exceeds body"),
        (lambda d: d.replace(b"Content-Length: 10", b"Content-Length: ten"), "bad Content-Length"),
        (lambda d: d.replace(b"Call-ID: a84b4c76e66710@pc33.example.com\r\n", b""), "missing Call-ID"),
        (lambda d: d.replace(b"CSeq: 314159 INVITE", b"CSeq: 314159 BYE"), "does not match"),
        (lambda d: d.replace(b"CSeq: 314159 INVITE", b"CSeq: 99999999999 INVITE"), "out of range"),
        (lambda d: d.replace(b"Max-Forwards: 69", b"Max-Forwards: lots"), "Max-Forwards"),
        (lambda d: d.replace(b"Contact:", b"Contact"), "bad header line"),
    ],
)
def test_malformed_requests_keep_enough_to_answer_400(mutate, reason):
    with pytest.raises(ParseError, match=reason) as caught:
        parse(mutate(INVITE))
    partial = caught.value.partial
    assert isinstance(partial, SipRequest) and partial.method == "INVITE"
    assert partial.vias[0].branch == "z9hG4bK776asdhds"


@pytest.mark.parametrize(
    "data",
    [
        b"\x16\x03\x01\x02\x00garbage",
        b"INVITE sip:x@y SIP/2.0\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\n",  # no blank line
        b"INVITE  sip:x@y SIP/2.0\r\n\r\n",  # two spaces in the request line
        b"INVITE sip:x@y SIP/two\r\n\r\n",
        b"SIP/2.0 2000 OK\r\n\r\n",
    ],
)
def test_garbage_is_a_parse_error_without_partial(data):
    with pytest.raises(ParseError) as caught:
        parse(data)
    assert caught.value.partial is None


def test_other_sip_version_keeps_the_headers_for_a_505():
    with pytest.raises(ParseError) as caught:
        parse(b"INVITE sip:x@y SIP/7.0\r\nVia: SIP/2.0/UDP h;branch=z9hG4bK1\r\n\r\n")
    assert caught.value.status == 505 and caught.value.partial.vias[0].branch == "z9hG4bK1"


def test_via_received_rport_round_trip():
    via = Via.parse("SIP/2.0/UDP 192.0.2.1:5062;branch=z9hG4bKx;rport")
    assert via.has_param("rport") and via.param("rport") is None
    stamped = via.with_param("rport", "40000").with_param("received", "198.51.100.7")
    assert str(stamped) == "SIP/2.0/UDP 192.0.2.1:5062;branch=z9hG4bKx;rport=40000;received=198.51.100.7"


def test_name_addr_and_uri():
    contact = NameAddr.parse('"A, B" <sip:bob:secret@[2001:db8::1]:5070;transport=tcp>;expires=60')
    assert contact.display == '"A, B"' and contact.params == (("expires", "60"),)
    uri = SipUri.parse(contact.uri)
    assert (uri.user, uri.host, uri.port, uri.param("transport")) == ("bob", "2001:db8::1", 5070, "tcp")


def test_make_response_copies_dialog_headers_and_adds_to_tag():
    request = parse(INVITE)
    assert isinstance(request, SipRequest)
    response = make_response(request, 180, "Ringing", to_tag="gw1", headers=(("Server", "gw"),))
    assert response.serialize() == (
        b"SIP/2.0 180 Ringing\r\n"
        b"Via: SIP/2.0/UDP 192.0.2.10:5060;branch=z9hG4bK776asdhds;rport\r\n"
        b"Via: SIP/2.0/TCP proxy.example.com;branch=z9hG4bK-p1\r\n"
        b'From: "Alice" <sip:alice@example.com>;tag=1928301774\r\n'
        b"To: <sip:+15551234@gw.example.com>;tag=gw1\r\n"
        b"Call-ID: a84b4c76e66710@pc33.example.com\r\n"
        b"CSeq: 314159 INVITE\r\n"
        b"Server: gw\r\n"
        b"Content-Length: 0\r\n\r\n"
    )
