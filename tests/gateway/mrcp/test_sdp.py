"""The MRCPv2 control stream in SDP (RFC 6787 §4.2): UniMRCP's real offer, our answer byte for byte."""

from __future__ import annotations

import pytest

from gateway.media.sdp import SdpAnswerer
from gateway.mrcp.sdp import MrcpOfferError, answer_with_control, is_mrcp_offer, synthesizer_offer
from engines.ssml import Pause
from gateway.mrcp.speech_text import SpeechTextError, speak_request

# What UniMRCP 1.8's client (umc, profile uni2) sends
UNIMRCP_OFFER = ("v=0\r\no=UniMRCPClient 0 0 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                 "m=application 9 TCP/MRCPv2 1\r\na=setup:active\r\na=connection:new\r\na=resource:speechsynth\r\n"
                 "a=cmid:1\r\nm=audio 4000 RTP/AVP 0 8 9 96 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\n"
                 "a=rtpmap:9 G722/8000\r\na=rtpmap:96 L16/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
                 "a=fmtp:101 0-15\r\na=recvonly\r\na=ptime:20\r\na=mid:1\r\n")


def test_answer_carries_channel_setup_connection_and_mids():
    control = synthesizer_offer(UNIMRCP_OFFER, tls_available=False)
    audio_answer, plan = SdpAnswerer("127.0.0.1", 20000, session_id=42).answer(UNIMRCP_OFFER)
    answer = answer_with_control(audio_answer, control, 1544, "abc123")
    assert answer == ("v=0\r\no=- 42 0 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
                      "m=application 1544 TCP/MRCPv2 1\r\na=setup:passive\r\na=connection:new\r\n"
                      "a=channel:abc123@speechsynth\r\na=cmid:1\r\n"
                      "m=audio 20000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
                      "a=fmtp:101 0-15\r\na=ptime:20\r\na=sendonly\r\na=mid:1\r\n")
    assert plan.can_send  # the client only receives: we send


def test_existing_connection_is_echoed():
    offer = UNIMRCP_OFFER.replace("a=connection:new", "a=connection:existing")
    assert synthesizer_offer(offer, tls_available=False).connection == "existing"


def test_routing_by_offer():
    assert is_mrcp_offer(UNIMRCP_OFFER)
    assert not is_mrcp_offer(UNIMRCP_OFFER.replace("m=application 9 TCP/MRCPv2 1\r\n", "m=video 0 RTP/AVP 31\r\n"))
    assert not is_mrcp_offer(None)
    assert not is_mrcp_offer("garbage")


@pytest.mark.parametrize(("change", "words"), [
    (("a=resource:speechsynth", "a=resource:speechrecog"), "speechrecog"),
    (("a=setup:active", "a=setup:passive"), "must connect"),
    (("a=connection:new", "a=connection:sometimes"), "new or existing"),
    (("TCP/MRCPv2", "TCP/TLS/MRCPv2"), "mrcp.tls"),
])
def test_offers_we_cannot_serve_are_named(change, words):
    with pytest.raises(MrcpOfferError, match=words):
        synthesizer_offer(UNIMRCP_OFFER.replace(*change), tls_available=False)


def test_ssml_goes_through_the_one_ssml_module_breaks_as_silence():
    document = (b'<?xml version="1.0"?><speak version="1.0" xml:lang="en-US" '
                b'xmlns="http://www.w3.org/2001/10/synthesis"><p><s>Welcome to</s><s>Uni MRCP.</s></p>'
                b'<break time="300ms"/>Call <sub alias="World Wide Web">WWW</sub> now</speak>')
    request = speak_request("application/ssml+xml", document, "en")
    words = " ".join(request.text.split())
    assert "Welcome to" in words and "Uni MRCP." in words and "Call World Wide Web now" in words
    assert "WWW" not in words
    # the paragraph's pause and the 300 ms break are one silence before "Call ..." (joined by engines.ssml)
    pauses = [segment.ms for segment in request.segments if isinstance(segment, Pause)]
    assert max(pauses) >= 300 and request.segments[-1].text == "Call World Wide Web now"


def test_plain_text_is_spoken_as_written_even_when_it_looks_like_markup():
    request = speak_request("text/plain", "  <speak>not parsed</speak> ".encode(), "en")
    assert (request.text, request.segments) == ("<speak>not parsed</speak>", ())


@pytest.mark.parametrize("document", [
    b'<?xml version="1.0"?><!DOCTYPE speak [<!ENTITY a "aaaa">]><speak>&a;</speak>',  # entity expansion
    b"<speak>unclosed",
    b"\xff\xfe",
])
def test_ssml_that_cannot_be_spoken(document):
    with pytest.raises(SpeechTextError):
        speak_request("application/ssml+xml", document, "en")
