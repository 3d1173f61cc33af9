"""SDP offer/answer (RFC 4566, RFC 3264): what a phone offers and what we must answer."""

from __future__ import annotations

import pytest

from gateway.media.sdp import NoCommonCodec, SdpAnswerer, SdpError, check_offer, parse_sdp


def offer(formats: str, *lines: str, port: int = 4000, session_c: str | None = "192.0.2.10") -> str:
    head = ["v=0", "o=alice 2890844526 2890844526 IN IP4 192.0.2.10", "s=-", "t=0 0"]
    if session_c:
        head.insert(3, f"c=IN IP4 {session_c}")
    return "\r\n".join([*head, f"m=audio {port} RTP/AVP {formats}", *lines]) + "\r\n"


TE = ("a=rtpmap:101 telephone-event/8000", "a=fmtp:101 0-16")


def answerer(supported=("PCMU", "PCMA")) -> SdpAnswerer:
    return SdpAnswerer(local_host="198.51.100.1", local_port=20000, supported=supported, session_id=42)


def test_pcma_first_in_offer_is_chosen() -> None:
    sdp, plan = answerer().answer(offer("8 0 101", *TE))
    assert (plan.codec, plan.payload_type, plan.clock_rate, plan.ptime) == ("PCMA", 8, 8000, 20)
    media = parse_sdp(sdp).media[0]
    assert media.formats == ("8", "101") and media.port == 20000
    assert ("rtpmap", "8 PCMA/8000") in media.attributes and ("ptime", "20") in media.attributes


def test_pcmu_first_in_offer_is_chosen() -> None:
    _, plan = answerer().answer(offer("0 8"))
    assert (plan.codec, plan.payload_type, plan.telephone_event_pt) == ("PCMU", 0, None)


def test_configured_supported_list_restricts_choice() -> None:
    _, plan = answerer(supported=("PCMA",)).answer(offer("0 8"))
    assert plan.codec == "PCMA"


def test_dynamic_payload_type_mapped_by_rtpmap() -> None:
    _, plan = answerer().answer(offer("96 101", "a=rtpmap:96 pcmu/8000", *TE))
    assert (plan.codec, plan.payload_type) == ("PCMU", 96)


def test_only_g729_is_no_common_codec() -> None:
    with pytest.raises(NoCommonCodec):
        answerer().answer(offer("18", "a=rtpmap:18 G729/8000"))


def test_telephone_event_answered_with_the_offers_payload_type() -> None:
    sdp, plan = answerer().answer(offer("0 118", "a=rtpmap:118 telephone-event/8000", "a=fmtp:118 0-15"))
    assert plan.telephone_event_pt == 118
    media = parse_sdp(sdp).media[0]
    assert media.formats == ("0", "118")
    assert ("rtpmap", "118 telephone-event/8000") in media.attributes and ("fmtp", "118 0-15") in media.attributes


@pytest.mark.parametrize("offered, answered, can_send", [
    ("sendrecv", "sendrecv", True), ("sendonly", "recvonly", False),
    ("recvonly", "sendonly", True), ("inactive", "inactive", False),
])
def test_direction_is_mirrored(offered: str, answered: str, can_send: bool) -> None:
    sdp, plan = answerer().answer(offer("0", f"a={offered}"))
    assert (plan.direction, plan.can_send) == (answered, can_send)
    assert parse_sdp(sdp).media[0].has_attribute(answered)


def test_session_level_direction_and_old_style_hold_address() -> None:
    text = offer("0").replace("t=0 0", "t=0 0\r\na=sendonly")
    assert answerer().answer(text)[1].can_send is False
    assert answerer().answer(offer("0", session_c="0.0.0.0"))[1].can_send is False


def test_media_level_connection_overrides_session_level() -> None:
    _, plan = answerer().answer(offer("0", "c=IN IP4 203.0.113.7", port=5004))
    assert (plan.remote_host, plan.remote_port, plan.remote_rtcp_port) == ("203.0.113.7", 5004, 5005)
    _, plan = answerer().answer(offer("0", "c=IN IP4 203.0.113.7", "a=rtcp:6000", session_c=None))
    assert (plan.remote_host, plan.remote_rtcp_port) == ("203.0.113.7", 6000)


def test_port_zero_and_other_streams_are_rejected_with_port_zero() -> None:
    text = offer("0", port=0) + "m=audio 4002 RTP/AVP 8\r\nm=video 4004 RTP/AVP 31\r\n"
    sdp, plan = answerer().answer(text)
    assert (plan.remote_port, plan.codec) == (4002, "PCMA")
    ports = [(m.media, m.port) for m in parse_sdp(sdp).media]
    assert ports == [("audio", 0), ("audio", 20000), ("video", 0)]  # one m= line per offered stream


def test_only_port_zero_audio_is_refused() -> None:
    with pytest.raises(NoCommonCodec, match="disabled"):  # RFC 3264 §5.1: port 0 disables the stream
        answerer().answer(offer("0", port=0))
    check_offer(offer("0", port=0))  # not broken SDP: the call layer refuses it (488, no usable audio)


@pytest.mark.parametrize("port, lines, named", [
    (4000, ("a=rtcp:70000",), "a=rtcp:70000"),
    (4000, ("a=rtcp:65536 IN IP4 192.0.2.10",), "a=rtcp:65536"),
    (4000, ("a=rtcp:0",), "a=rtcp:0"),
    (4000, ("a=rtcp:abc",), "a=rtcp:abc"),
    (4000, ("a=rtcp:",), "a=rtcp:"),
    (65535, (), "m=audio port 65535"),  # its RTCP would go to 65536 (RFC 3550 §11)
])
def test_an_rtcp_port_we_cannot_send_to_is_refused_naming_the_attribute(port, lines, named) -> None:
    text = offer("0", *lines, port=port)
    with pytest.raises(SdpError, match=named):
        check_offer(text)
    with pytest.raises(SdpError, match=named):
        answerer().answer(text)


def test_the_rtcp_port_comes_from_a_rtcp_or_the_next_port() -> None:
    assert answerer().answer(offer("0", "a=rtcp:65535", port=65534))[1].remote_rtcp_port == 65535
    assert answerer().answer(offer("0", "a=rtcp:9 IN IP4 192.0.2.10", port=65535))[1].remote_rtcp_port == 9
    assert answerer().answer(offer("0", port=4000))[1].remote_rtcp_port == 4001
    check_offer(offer("0", "a=rtcp:70000", port=0))  # a disabled stream's attributes are not judged


def test_origin_version_increments_only_when_the_answer_changes() -> None:
    session = answerer()

    def origin(sdp: str) -> list[str]:
        return parse_sdp(sdp).origin.split()

    first = origin(session.answer(offer("0 8", *TE))[0])
    same = origin(session.answer(offer("0 8", *TE))[0])
    held = origin(session.answer(offer("0 8", *TE, "a=sendonly"))[0])
    resumed = origin(session.answer(offer("0 8", *TE, "a=sendrecv"))[0])
    assert first[1] == same[1] == held[1] == resumed[1] == "42"  # session id constant (§8)
    assert [int(o[2]) for o in (first, same, held, resumed)] == [0, 0, 1, 2]


def test_reoffer_keeps_the_current_codec_if_still_offered() -> None:
    session = answerer()
    assert session.answer(offer("0 8"))[1].codec == "PCMU"
    assert session.answer(offer("8 0"))[1].codec == "PCMU"
    assert session.answer(offer("8"))[1].codec == "PCMA"


def test_failed_reoffer_changes_nothing() -> None:
    session = answerer()
    first, _ = session.answer(offer("0"))
    with pytest.raises(NoCommonCodec):
        session.answer(offer("18"))
    assert session.answer(offer("0"))[0] == first


def test_a_reoffer_that_disables_the_audio_stream_is_refused_and_the_session_stays() -> None:
    """RFC 3264 §8.2 removes a stream with port 0; the call would have no audio, so the re-offer gets 488
    and the session stays as it was (RFC 3261 §14.2)."""
    session = answerer()
    sdp, plan = session.answer(offer("0"))
    with pytest.raises(NoCommonCodec, match="disabled"):
        session.answer(offer("0", port=0))
    assert session.answer(offer("0")) == (sdp, plan)


def test_g722_first_in_offer_is_answered_at_8000_in_sdp_with_16khz_audio() -> None:
    """RFC 3551 §4.5.2: G.722 is 'G722/8000' in SDP and on the RTP clock, though its audio is 16 kHz."""
    sdp, plan = answerer(("PCMU", "PCMA", "G722")).answer(offer("9 0 8 101", "a=rtpmap:9 G722/8000", *TE))
    assert (plan.codec, plan.payload_type, plan.clock_rate, plan.audio_rate) == ("G722", 9, 8000, 16000)
    media = parse_sdp(sdp).media[0]
    assert media.formats == ("9", "101") and ("rtpmap", "9 G722/8000") in media.attributes


def test_g722_offered_after_g711_follows_the_offer_unless_the_config_orders() -> None:
    ours = ("G722", "PCMU", "PCMA")
    _, plan = answerer(ours).answer(offer("0 8 9"))
    assert (plan.codec, plan.audio_rate) == ("PCMU", 8000)
    _, plan = SdpAnswerer("198.51.100.1", 20000, ours, codec_order="config").answer(offer("0 8 9"))
    assert plan.codec == "G722"
    _, plan = SdpAnswerer("198.51.100.1", 20000, ("PCMU", "PCMA"), codec_order="config").answer(offer("9 8 0"))
    assert plan.codec == "PCMU"  # not configured: never chosen


def test_a_reoffer_never_changes_the_audio_rate() -> None:
    """The prompt playing is buffered at the call's rate: a re-offer may move PCMU -> PCMA, not G.722 -> G.711."""
    sdp_answerer = answerer(("PCMU", "PCMA", "G722"))
    sdp_answerer.answer(offer("9 0"))
    with pytest.raises(NoCommonCodec):
        sdp_answerer.answer(offer("0 8"))
    _, plan = sdp_answerer.answer(offer("0 9"))
    assert plan.codec == "G722"
