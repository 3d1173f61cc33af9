"""RTP data packets (RFC 3550 §5.1): parse and serialize, nothing else.

No sockets, no clocks. `RtpPacket.serialize` is used on the per-packet send path, so it is a single
struct pack plus concatenation in the common case (no CSRCs, no extension, no padding).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

RTP_VERSION = 2
_FIXED = struct.Struct("!BBHII")  # V/P/X/CC, M/PT, sequence number, timestamp, SSRC (RFC 3550 §5.1)
_EXTENSION = struct.Struct("!HH")  # profile-defined id, length in 32-bit words (RFC 3550 §5.3.1)


class RtpParseError(ValueError):
    """The datagram is not a well-formed RTP version 2 packet."""


@dataclass(frozen=True)
class RtpPacket:
    payload_type: int
    sequence_number: int
    timestamp: int
    ssrc: int
    payload: bytes = b""
    marker: bool = False
    csrcs: tuple[int, ...] = ()
    extension_profile: int | None = None  # present iff the X bit is set
    extension: bytes = b""  # header extension body, a multiple of 4 bytes
    padding: int = 0  # number of padding octets, including the count octet itself (RFC 3550 §5.1 P)

    @classmethod
    def parse(cls, data: bytes) -> RtpPacket:
        if len(data) < _FIXED.size:
            raise RtpParseError(f"RTP packet too short: {len(data)} bytes")
        first, second, seq, ts, ssrc = _FIXED.unpack_from(data)
        if first >> 6 != RTP_VERSION:
            raise RtpParseError(f"RTP version {first >> 6}, expected 2")
        offset = _FIXED.size
        csrc_count = first & 0x0F
        if len(data) < offset + 4 * csrc_count:
            raise RtpParseError("RTP packet truncated in CSRC list")
        csrcs = struct.unpack_from(f"!{csrc_count}I", data, offset)
        offset += 4 * csrc_count
        profile: int | None = None
        extension = b""
        if first & 0x10:
            if len(data) < offset + _EXTENSION.size:
                raise RtpParseError("RTP packet truncated in header extension")
            profile, words = _EXTENSION.unpack_from(data, offset)
            offset += _EXTENSION.size
            extension = data[offset : offset + 4 * words]
            if len(extension) != 4 * words:
                raise RtpParseError("RTP header extension longer than the packet")
            offset += 4 * words
        end = len(data)
        padding = 0
        if first & 0x20:
            # The last octet counts the padding octets, itself included (RFC 3550 §5.1).
            padding = data[-1]
            if padding == 0 or offset + padding > end:
                raise RtpParseError(f"bad RTP padding count {padding}")
            end -= padding
        return cls(
            payload_type=second & 0x7F,
            sequence_number=seq,
            timestamp=ts,
            ssrc=ssrc,
            payload=bytes(data[offset:end]),
            marker=bool(second & 0x80),
            csrcs=tuple(csrcs),
            extension_profile=profile,
            extension=bytes(extension),
            padding=padding,
        )

    def serialize(self) -> bytes:
        first = (RTP_VERSION << 6) | len(self.csrcs)
        if self.padding:
            first |= 0x20
        if self.extension_profile is not None:
            first |= 0x10
        header = _FIXED.pack(
            first, (self.marker << 7) | self.payload_type, self.sequence_number, self.timestamp, self.ssrc
        )
        if self.csrcs:
            header += struct.pack(f"!{len(self.csrcs)}I", *self.csrcs)
        if self.extension_profile is not None:
            header += _EXTENSION.pack(self.extension_profile, len(self.extension) // 4) + self.extension
        if self.padding:
            return header + self.payload + bytes(self.padding - 1) + bytes([self.padding])
        return header + self.payload


def pack_header(payload_type: int, sequence_number: int, timestamp: int, ssrc: int, marker: bool) -> bytes:
    """The 12-byte fixed header alone: the send path's fast form of `RtpPacket(...).serialize()`."""
    return _FIXED.pack(0x80, (marker << 7) | payload_type, sequence_number, timestamp, ssrc)


def is_rtcp(data: bytes) -> bool:
    """True for RTCP multiplexed onto the RTP port: packet types 64-95 never occur as RTP PTs (RFC 5761 §4)."""
    return len(data) >= 2 and 192 <= data[1] <= 223
