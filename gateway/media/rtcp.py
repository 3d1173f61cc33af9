"""RTCP (RFC 3550 §6): build our sender report, parse what peers send without choking on it.

We send one compound packet per report interval: SR (§6.4.1) + SDES with our CNAME (§6.5.1), as the
compound rules of §6.1 require. Incoming compound packets are split into SR, RR (§6.4.2), BYE (§6.6)
and, for any other type (SDES, APP, XR, feedback), an `RtcpOther` that carries only its type, so a
peer's extensions never break the session. No sockets, no clocks: callers pass the wallclock in.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

SR, RR, SDES, BYE = 200, 201, 202, 203
_HEADER = struct.Struct("!BBH")  # V/P/count, packet type, length in 32-bit words minus one (§6.4.1)
_SENDER_INFO = struct.Struct("!IIIIII")  # SSRC, NTP msw, NTP lsw, RTP timestamp, packet count, octet count
_REPORT_BLOCK = struct.Struct("!IIIIII")  # §6.4.1 report block, 24 bytes
_NTP_EPOCH_OFFSET = 2_208_988_800  # seconds from 1900-01-01 (NTP era 0) to 1970-01-01 (Unix)


class RtcpParseError(ValueError):
    """The datagram is not a well-formed RTCP compound packet."""


@dataclass(frozen=True)
class ReportBlock:
    ssrc: int
    fraction_lost: int
    cumulative_lost: int  # signed 24-bit
    highest_sequence: int
    jitter: int
    last_sr: int
    delay_since_last_sr: int


@dataclass(frozen=True)
class SenderReport:
    ssrc: int
    ntp_timestamp: int  # 64-bit NTP format: seconds since 1900 in the high word, fraction in the low
    rtp_timestamp: int
    packet_count: int
    octet_count: int
    reports: tuple[ReportBlock, ...] = ()


@dataclass(frozen=True)
class ReceiverReport:
    ssrc: int
    reports: tuple[ReportBlock, ...] = ()


@dataclass(frozen=True)
class Bye:
    ssrcs: tuple[int, ...]
    reason: str = ""


@dataclass(frozen=True)
class RtcpOther:
    packet_type: int


RtcpPacket = SenderReport | ReceiverReport | Bye | RtcpOther


def ntp_timestamp(unix_seconds: float) -> int:
    """Wallclock as the 64-bit NTP timestamp of RFC 3550 §4."""
    seconds = int(unix_seconds)
    fraction = int((unix_seconds - seconds) * (1 << 32)) & 0xFFFFFFFF
    return ((seconds + _NTP_EPOCH_OFFSET) & 0xFFFFFFFF) << 32 | fraction


def _header(count: int, packet_type: int, body_len: int) -> bytes:
    return _HEADER.pack(0x80 | count, packet_type, (body_len + 4) // 4 - 1)


def _pack_block(block: ReportBlock) -> bytes:
    lost = ((block.fraction_lost & 0xFF) << 24) | (block.cumulative_lost & 0xFFFFFF)
    return _REPORT_BLOCK.pack(
        block.ssrc, lost, block.highest_sequence, block.jitter, block.last_sr, block.delay_since_last_sr
    )


def serialize_sender_report(report: SenderReport) -> bytes:
    body = _SENDER_INFO.pack(
        report.ssrc, report.ntp_timestamp >> 32, report.ntp_timestamp & 0xFFFFFFFF,
        report.rtp_timestamp, report.packet_count, report.octet_count,
    ) + b"".join(_pack_block(b) for b in report.reports)
    return _header(len(report.reports), SR, len(body)) + body


def serialize_receiver_report(report: ReceiverReport) -> bytes:
    body = struct.pack("!I", report.ssrc) + b"".join(_pack_block(b) for b in report.reports)
    return _header(len(report.reports), RR, len(body)) + body


def serialize_sdes_cname(ssrc: int, cname: str) -> bytes:
    """One SDES chunk with a CNAME item (§6.5.1), null-terminated and padded to a 32-bit boundary."""
    text = cname.encode()[:255]
    chunk = struct.pack("!IBB", ssrc, 1, len(text)) + text + b"\x00"
    chunk += bytes(-len(chunk) % 4)
    return _header(1, SDES, len(chunk)) + chunk


def serialize_bye(bye: Bye) -> bytes:
    body = b"".join(struct.pack("!I", s) for s in bye.ssrcs)
    if bye.reason:
        reason = bye.reason.encode()[:255]
        body += bytes([len(reason)]) + reason
        body += bytes(-len(body) % 4)
    return _header(len(bye.ssrcs), BYE, len(body)) + body


def _parse_blocks(data: bytes, offset: int, count: int) -> tuple[ReportBlock, ...]:
    blocks = []
    for i in range(count):
        ssrc, lost, highest, jitter, lsr, dlsr = _REPORT_BLOCK.unpack_from(data, offset + i * _REPORT_BLOCK.size)
        cumulative = lost & 0xFFFFFF
        if cumulative & 0x800000:
            cumulative -= 1 << 24
        blocks.append(ReportBlock(ssrc, lost >> 24, cumulative, highest, jitter, lsr, dlsr))
    return tuple(blocks)


def _parse_one(packet_type: int, count: int, body: bytes) -> RtcpPacket:
    if packet_type == SR:
        if len(body) < _SENDER_INFO.size + count * _REPORT_BLOCK.size:
            raise RtcpParseError("RTCP SR shorter than its report count")
        ssrc, msw, lsw, rtp_ts, packets, octets = _SENDER_INFO.unpack_from(body)
        return SenderReport(ssrc, msw << 32 | lsw, rtp_ts, packets, octets, _parse_blocks(body, _SENDER_INFO.size, count))
    if packet_type == RR:
        if len(body) < 4 + count * _REPORT_BLOCK.size:
            raise RtcpParseError("RTCP RR shorter than its report count")
        (ssrc,) = struct.unpack_from("!I", body)
        return ReceiverReport(ssrc, _parse_blocks(body, 4, count))
    if packet_type == BYE:
        if len(body) < 4 * count:
            raise RtcpParseError("RTCP BYE shorter than its source count")
        ssrcs = struct.unpack_from(f"!{count}I", body)
        reason = ""
        if len(body) > 4 * count:
            length = body[4 * count]
            reason = body[4 * count + 1 : 4 * count + 1 + length].decode("utf-8", "replace")
        return Bye(tuple(ssrcs), reason)
    return RtcpOther(packet_type)


def parse_compound(data: bytes) -> list[RtcpPacket]:
    """Split a compound RTCP datagram (§6.1) into its packets; raises RtcpParseError if malformed."""
    packets: list[RtcpPacket] = []
    offset = 0
    while offset < len(data):
        if len(data) - offset < _HEADER.size:
            raise RtcpParseError("trailing bytes after the last RTCP packet")
        first, packet_type, words = _HEADER.unpack_from(data, offset)
        if first >> 6 != 2:
            raise RtcpParseError(f"RTCP version {first >> 6}, expected 2")
        end = offset + 4 * (words + 1)
        if end > len(data):
            raise RtcpParseError("RTCP length field runs past the datagram")
        body = data[offset + _HEADER.size : end]
        if first & 0x20:  # padding is only allowed on the last packet; its last octet counts it (§6.4.1)
            body = body[: len(body) - body[-1]] if body else body
        packets.append(_parse_one(packet_type, first & 0x1F, body))
        offset = end
    if not packets:
        raise RtcpParseError("empty RTCP datagram")
    return packets
