"""Per-stream RTP timing from a pcap (tcpdump -w) of loopback traffic: what the callers really got.

Reads classic pcap (micro- or nanosecond timestamps; Ethernet, Linux cooked or raw IPv4 link types),
keeps UDP packets that parse as RTP version 2, and groups them by SSRC. For each stream: the
inter-packet send intervals, sequence gaps and timestamp steps. Only headers are needed, so capture
with a small snaplen (`-s 64`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

_LINK_OFFSETS = {1: 14, 113: 16, 101: 0, 228: 0}  # Ethernet, Linux SLL, raw IP, IPv4


@dataclass
class RtpStream:
    ssrc: int
    times: list[float] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    stamps: list[int] = field(default_factory=list)
    payload_types: set[int] = field(default_factory=set)

    def intervals_ms(self) -> np.ndarray:
        return np.diff(np.asarray(self.times)) * 1000.0

    def seq_gaps(self) -> int:
        steps = np.diff(np.asarray(self.seqs, dtype=np.int64)) % 65536
        return int(np.sum(steps != 1))

    def bad_timestamp_steps(self, step: int = 160) -> int:
        steps = np.diff(np.asarray(self.stamps, dtype=np.int64)) % (1 << 32)
        seq_steps = np.diff(np.asarray(self.seqs, dtype=np.int64)) % 65536
        return int(np.sum((steps != step) & (seq_steps == 1)))


def read_rtp_streams(path: str | Path) -> dict[int, RtpStream]:
    data = Path(path).read_bytes()
    magic = data[:4]
    if magic in (b"\xd4\xc3\xb2\xa1", b"\x4d\x3c\xb2\xa1"):
        endian = "<"
    elif magic in (b"\xa1\xb2\xc3\xd4", b"\xa1\xb2\x3c\x4d"):
        endian = ">"
    else:
        raise ValueError(f"{path}: not a classic pcap file (pcapng is not supported; use tcpdump -w)")
    nano = magic in (b"\x4d\x3c\xb2\xa1", b"\xa1\xb2\x3c\x4d")
    linktype = struct.unpack(endian + "I", data[20:24])[0]
    if linktype not in _LINK_OFFSETS:
        raise ValueError(f"{path}: unsupported link type {linktype}")
    link = _LINK_OFFSETS[linktype]
    scale = 1e-9 if nano else 1e-6
    streams: dict[int, RtpStream] = {}
    pos = 24
    record = struct.Struct(endian + "IIII")
    while pos + 16 <= len(data):
        sec, frac, incl, _orig = record.unpack_from(data, pos)
        pkt = data[pos + 16: pos + 16 + incl]
        pos += 16 + incl
        ip = pkt[link:]
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != 17:
            continue
        udp = ip[(ip[0] & 0x0F) * 4:]
        rtp = udp[8:]
        if len(rtp) < 12 or rtp[0] >> 6 != 2 or 72 <= (rtp[1] & 0x7F) <= 76:  # skip RTCP (PT 200-204)
            continue
        seq, stamp, ssrc = struct.unpack("!HII", rtp[2:12])
        stream = streams.setdefault(ssrc, RtpStream(ssrc))
        stream.times.append(sec + frac * scale)
        stream.seqs.append(seq)
        stream.stamps.append(stamp)
        stream.payload_types.add(rtp[1] & 0x7F)
    return streams


def steady_window(streams: dict[int, RtpStream], min_packets: int = 10) -> tuple[float, float] | None:
    """From when the last stream started to when the first one ended: every stream is sending."""
    used = [s for s in streams.values() if len(s.times) >= min_packets]
    if not used:
        return None
    start, end = max(s.times[0] for s in used), min(s.times[-1] for s in used)
    return (start, end) if end > start else None


def summarize(streams: dict[int, RtpStream], min_packets: int = 10,
              window: tuple[float, float] | None = None) -> dict[str, float]:
    """Interval statistics over all streams; with `window`, only intervals that end inside it."""
    used = [s for s in streams.values() if len(s.times) >= min_packets]
    if not used:
        return {"streams": 0}
    if window is None:
        intervals = np.concatenate([s.intervals_ms() for s in used])
    else:
        parts = []
        for s in used:
            times = np.asarray(s.times)
            inside = (times[1:] >= window[0]) & (times[1:] <= window[1])
            parts.append(np.diff(times)[inside] * 1000.0)
        intervals = np.concatenate(parts)
        if intervals.size == 0:
            return {"streams": len(used), "window_s": window[1] - window[0]}
    return {
        "streams": len(used),
        **({"window_s": round(window[1] - window[0], 2)} if window else {}),
        "packets": int(sum(len(s.times) for s in used)),
        "interval_p50_ms": float(np.percentile(intervals, 50)),
        "interval_p99_ms": float(np.percentile(intervals, 99)),
        "interval_max_ms": float(intervals.max()),
        "seq_gaps": sum(s.seq_gaps() for s in used),
        "bad_ts_steps": sum(s.bad_timestamp_steps() for s in used),
    }
