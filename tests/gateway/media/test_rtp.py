"""RTP packets byte-for-byte (RFC 3550 §5.1)."""

from __future__ import annotations

import pytest

from gateway.media.rtp import RtpPacket, RtpParseError, is_rtcp, pack_header


def test_plain_packet_bytes() -> None:
    packet = RtpPacket(payload_type=0, sequence_number=0x1234, timestamp=0xA0, ssrc=0xDEADBEEF,
                       payload=b"\xff" * 160, marker=True)
    wire = bytes.fromhex("80 80 1234 000000a0 deadbeef") + b"\xff" * 160
    assert packet.serialize() == wire
    assert RtpPacket.parse(wire) == packet
    assert pack_header(0, 0x1234, 0xA0, 0xDEADBEEF, True) == wire[:12]


def test_csrc_extension_and_padding_round_trip() -> None:
    wire = bytes.fromhex(
        "b2 08 ffff ffffffff 00000001"  # V=2 P=1 X=1 CC=2, PT 8, seq 65535
        "0000000a 0000000b"  # two CSRCs
        "bede 0001 10ff0000"  # one-byte header extension, 1 word
        "d5d5d5"  # payload
        "000003"  # 3 padding octets, count last
    )
    packet = RtpPacket.parse(wire)
    assert (packet.payload_type, packet.sequence_number, packet.timestamp, packet.ssrc) == (8, 0xFFFF, 0xFFFFFFFF, 1)
    assert packet.csrcs == (10, 11)
    assert (packet.extension_profile, packet.extension) == (0xBEDE, bytes.fromhex("10ff0000"))
    assert packet.payload == b"\xd5\xd5\xd5" and packet.padding == 3 and not packet.marker
    assert packet.serialize() == wire


@pytest.mark.parametrize("wire", [
    b"\x80\x00\x00",  # shorter than the fixed header
    bytes.fromhex("40 00 0001 00000000 00000000"),  # version 1
    bytes.fromhex("81 00 0001 00000000 00000000"),  # CSRC count runs past the end
    bytes.fromhex("a0 00 0001 00000000 00000000 0005"),  # padding count larger than the packet
])
def test_malformed_packets_raise(wire: bytes) -> None:
    with pytest.raises(RtpParseError):
        RtpPacket.parse(wire)


def test_rtcp_is_told_apart_from_rtp_on_a_shared_port() -> None:
    assert is_rtcp(bytes.fromhex("80 c8 0006"))  # SR
    assert not is_rtcp(bytes.fromhex("80 00 0001"))  # PCMU
    assert not is_rtcp(bytes.fromhex("80 e5 0001"))  # marker + dynamic PT 101
