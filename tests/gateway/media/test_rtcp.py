"""RTCP sender reports byte-for-byte (RFC 3550 §6.4.1) and tolerant parsing of what peers send."""

from __future__ import annotations

import pytest

from gateway.media import rtcp

SR_WIRE = bytes.fromhex(
    "80 c8 0006"  # V=2, RC=0, PT=200, length 6 words
    "11223344"  # SSRC
    "83aa7e80 80000000"  # NTP 1970-01-01T00:00:00.5 (seconds since 1900, half a second)
    "00000640"  # RTP timestamp 1600
    "00000032 00001f40"  # 50 packets, 8000 octets
)


def test_ntp_timestamp_of_unix_epoch() -> None:
    assert rtcp.ntp_timestamp(0.5) == (2_208_988_800 << 32) | 0x80000000


def test_sender_report_bytes() -> None:
    report = rtcp.SenderReport(ssrc=0x11223344, ntp_timestamp=rtcp.ntp_timestamp(0.5), rtp_timestamp=1600,
                               packet_count=50, octet_count=8000)
    assert rtcp.serialize_sender_report(report) == SR_WIRE
    assert rtcp.parse_compound(SR_WIRE) == [report]


def test_compound_from_a_phone_rr_sdes_bye() -> None:
    block = bytes.fromhex("11223344 05fffffe 0001ffff 00000010 83aa7e80 00010000")
    wire = (
        bytes.fromhex("81 c9 0007 aabbccdd") + block  # RR with one block (cumulative lost -2)
        + rtcp.serialize_sdes_cname(0xAABBCCDD, "phone@10.0.0.2")
        + rtcp.serialize_bye(rtcp.Bye((0xAABBCCDD,), "hangup"))
        + bytes.fromhex("80 cc 0002 aabbccdd 6e616d65")  # APP: carried through as 'other'
    )
    rr, sdes, bye, app = rtcp.parse_compound(wire)
    assert rr == rtcp.ReceiverReport(0xAABBCCDD, (rtcp.ReportBlock(
        ssrc=0x11223344, fraction_lost=5, cumulative_lost=-2, highest_sequence=0x1FFFF, jitter=16,
        last_sr=0x83AA7E80, delay_since_last_sr=0x10000),))
    assert sdes == rtcp.RtcpOther(rtcp.SDES) and app == rtcp.RtcpOther(204)
    assert bye == rtcp.Bye((0xAABBCCDD,), "hangup")


def test_sdes_cname_is_padded_to_words() -> None:
    # SSRC, CNAME item (type 1, length 2, "ab"), a null end-of-items octet, padding to 32 bits (§6.5).
    assert rtcp.serialize_sdes_cname(1, "ab") == bytes.fromhex("81 ca 0003 00000001 0102 6162 00 000000")


@pytest.mark.parametrize("wire", [b"", b"\x80\xc8", SR_WIRE[:-4], bytes.fromhex("40 c8 0000")])
def test_malformed_rtcp_raises(wire: bytes) -> None:
    with pytest.raises(rtcp.RtcpParseError):
        rtcp.parse_compound(wire)
