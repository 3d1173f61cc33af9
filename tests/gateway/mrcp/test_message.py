"""MRCPv2 message codec (RFC 6787 §5): byte-exact serialization and the status each malformed request earns."""

from __future__ import annotations

import pytest

from gateway.mrcp.message import MessageError, MrcpEvent, MrcpResponse, read_request

SPEAK = (b"MRCP/2.0 {length} SPEAK 1\r\n"
         b"Channel-Identifier: 32AECB23433802@speechsynth\r\n"
         b"Content-Type: text/plain\r\n"
         b"Content-Length: 11\r\n"
         b"\r\n"
         b"Hello world")


def framed(template: bytes) -> bytes:
    """`template` with its {length} filled in as message-length counts it: the whole message, digits included."""
    length = len(template) - len(b"{length}")
    while len(template) - len(b"{length}") + len(str(length)) != length:
        length = len(template) - len(b"{length}") + len(str(length))
    return template.replace(b"{length}", str(length).encode())


def test_response_is_byte_exact_and_counts_its_own_length():
    response = MrcpResponse(1, 200, "IN-PROGRESS", (("Channel-Identifier", "32AECB23433802@speechsynth"),))
    data = response.serialize()
    assert data == (b"MRCP/2.0 81 1 200 IN-PROGRESS\r\n"
                    b"Channel-Identifier: 32AECB23433802@speechsynth\r\n\r\n")
    assert len(data) == 81


def test_event_with_body_carries_content_length():
    event = MrcpEvent("SPEAK-COMPLETE", 543257, "COMPLETE", (("Channel-Identifier", "x@speechsynth"),
                                                            ("Completion-Cause", "000 normal")), b"ab")
    data = event.serialize()
    assert data.startswith(b"MRCP/2.0 %d SPEAK-COMPLETE 543257 COMPLETE\r\n" % len(data))
    assert data.endswith(b"Completion-Cause: 000 normal\r\nContent-Length: 2\r\n\r\nab")


def test_length_across_a_digit_boundary():
    # 2 + 97 bytes: the length's own third digit pushes the message from 99 to 100 bytes
    for pad in range(40, 60):
        data = MrcpResponse(7, 200, "COMPLETE", (("Channel-Identifier", "c" * pad),)).serialize()
        assert int(data.split(b" ")[1]) == len(data)


def test_request_parses_with_headers_and_body():
    data = framed(SPEAK)
    request, used = read_request(data + b"MRCP/2.0", 65536)
    assert used == len(data)
    assert request.method == "SPEAK" and request.request_id == 1
    assert request.channel == "32AECB23433802@speechsynth"
    assert request.headers.get("content-type") == "text/plain"
    assert request.body == b"Hello world"


def test_incomplete_request_waits():
    data = framed(SPEAK)
    assert read_request(data[:10], 65536) is None
    assert read_request(data[:-1], 65536) is None


def test_folded_header_line_is_joined():
    data = framed(b"MRCP/2.0 {length} SET-PARAMS 3\r\nChannel-Identifier: a@speechsynth\r\n"
                  b"Voice-Name: Mary\r\n  Ann\r\n\r\n")
    request, _ = read_request(data, 65536)
    assert request.headers.get("Voice-Name") == "Mary Ann"


@pytest.mark.parametrize(("data", "status", "request_id", "frameable"), [
    (b"HELLO THERE\r\n\r\n", 408, 0, False),  # not a start line
    (b"MRCP/2.0 abc SPEAK 1\r\n\r\n", 408, 0, False),  # no length to frame by
    (b"MRCP/2.0 5 SPEAK 9\r\n\r\n", 408, 9, False),  # length shorter than the start line
    (b"MRCP/2.0 999999 SPEAK 4\r\n\r\n", 504, 4, False),  # over max_bytes
])
def test_unframeable_start_lines(data, status, request_id, frameable):
    with pytest.raises(MessageError) as caught:
        read_request(data, 65536)
    assert caught.value.status == status
    assert caught.value.request_id == request_id
    assert (caught.value.length is not None) == frameable


@pytest.mark.parametrize(("template", "status"), [
    (b"MRCP/1.0 {length} SPEAK 2\r\nChannel-Identifier: a@speechsynth\r\n\r\n", 502),
    (b"MRCP/2.0 {length} SP@AK 2\r\nChannel-Identifier: a@speechsynth\r\n\r\n", 408),
    (b"MRCP/2.0 {length} SPEAK 2\r\nChannel-Identifier a@speechsynth\r\n\r\n", 408),  # no colon
    (b"MRCP/2.0 {length} SPEAK 2\r\nChannel-Identifier: a@speechsynth\r\nContent-Length: 5\r\n\r\nabc", 408),
    (b"MRCP/2.0 {length} SPEAK 2\r\nChannel-Identifier: a@speechsynth\r\n\r\nabc", 408),  # body, no length
])
def test_frameable_errors_keep_the_stream(template, status):
    data = framed(template)
    with pytest.raises(MessageError) as caught:
        read_request(data + b"next", 65536)
    assert caught.value.status == status
    assert caught.value.request_id == 2
    assert caught.value.length == len(data)  # the next message starts right after


def test_request_id_beyond_32_bits_is_refused():
    data = framed(b"MRCP/2.0 {length} STOP 4294967296\r\nChannel-Identifier: a@speechsynth\r\n\r\n")
    with pytest.raises(MessageError) as caught:
        read_request(data, 65536)
    assert caught.value.status == 408
