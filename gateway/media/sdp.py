"""SDP offer/answer for one audio stream: parse an offer (RFC 4566), answer it (RFC 3264), plan the media.

We answer with G.711 (PCMU/PCMA) or G.722, 20 ms, plus telephone-event when offered. The codec is the
first one in the OFFER's order that we support (RFC 3264 §6.1 lets the answerer follow the offerer's
preference), or, with `codec_order="config"`, the first of our own list that the offer has; on a re-offer we
keep the current codec if it is still offered, so a hold/resume does not switch codecs mid-call, and never
switch to one of another audio rate (G.722's 16 kHz against G.711's 8 kHz: the prompt playing is buffered
at its rate), a 488 instead. Only the first usable audio stream is accepted; every other m= line is rejected
with port 0 (§6). The answer's o= line keeps its session id and increments its version only when the
answer changes (§8). No sockets, no clocks.
"""

from __future__ import annotations

import ipaddress
import random
from dataclasses import dataclass, field
from typing import Literal

from gateway.media.codecs import CODECS, RTP_CLOCK_RATE

# RFC 3551 §6, table 4. G.722 says 8000 although it carries 16 kHz audio (§4.5.2).
STATIC_PAYLOAD_TYPES = {codec.payload_type: (codec.name, RTP_CLOCK_RATE) for codec in CODECS.values()}
DIRECTIONS = ("sendrecv", "sendonly", "recvonly", "inactive")
_ANSWER_DIRECTION = {"sendrecv": "sendrecv", "sendonly": "recvonly", "recvonly": "sendonly", "inactive": "inactive"}
_RTP_PROFILES = ("RTP/AVP", "RTP/AVPF")  # plain RTP; SRTP profiles are rejected
PTIME_MS = 20


CodecOrder = Literal["offer", "config"]  # whose preference picks the codec: the offer's, or media.codecs'


class SdpError(ValueError):
    """The offer is not parseable SDP."""


class NoCommonCodec(ValueError):
    """No audio stream in the offer carries a codec we support (the call layer answers 488)."""


@dataclass(frozen=True)
class MediaDescription:
    media: str
    port: int
    proto: str
    formats: tuple[str, ...]
    connection: str | None  # media-level c= address, if any
    attributes: tuple[tuple[str, str | None], ...]

    def attribute(self, name: str) -> str | None:
        return next((value for key, value in self.attributes if key == name), None)

    def has_attribute(self, name: str) -> bool:
        return any(key == name for key, _ in self.attributes)


@dataclass(frozen=True)
class SessionDescription:
    origin: str
    connection: str | None  # session-level c= address, if any
    attributes: tuple[tuple[str, str | None], ...]
    media: tuple[MediaDescription, ...]


@dataclass(frozen=True)
class MediaPlan:
    """What the RTP session does, as negotiated: where to send, how to encode, whether it may send."""

    remote_host: str
    remote_port: int
    codec: str  # "PCMU", "PCMA" or "G722"
    payload_type: int
    clock_rate: int
    telephone_event_pt: int | None
    can_send: bool
    ptime: int  # ms per packet
    direction: str = "sendrecv"  # our answer's direction attribute
    remote_rtcp_port: int = 0  # a=rtcp (RFC 3605) if offered, else remote_port + 1 (RFC 3550 §11)

    @property
    def audio_rate(self) -> int:
        """Samples per second of the audio the codec carries (16000 for G.722; clock_rate is RTP's)."""
        return CODECS[self.codec].audio_rate


def _connection_address(value: str) -> str:
    parts = value.split()
    if len(parts) != 3 or parts[0] != "IN":
        raise SdpError(f"bad c= line: {value[:80]!r}")
    return parts[2].split("/", 1)[0]  # drop a multicast TTL / address count


def _attribute(value: str) -> tuple[str, str | None]:
    name, sep, rest = value.partition(":")
    return name.strip(), (rest.strip() if sep else None)


def parse_sdp(text: str) -> SessionDescription:
    origin = ""
    session_connection: str | None = None
    session_attributes: list[tuple[str, str | None]] = []
    media: list[dict] = []
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.strip()
        if not line:
            continue
        if len(line) < 2 or line[1] != "=":
            raise SdpError(f"bad SDP line: {line[:80]!r}")
        kind, value = line[0], line[2:]
        if kind == "m":
            parts = value.split()
            if len(parts) < 4 or not parts[1].split("/")[0].isdigit():
                raise SdpError(f"bad m= line: {value[:80]!r}")
            if int(parts[1].split("/")[0]) > 65535:  # RFC 4566 §5.14: a UDP port
                raise SdpError(f"m= port out of range: {parts[1][:20]}")
            media.append({"media": parts[0], "port": int(parts[1].split("/")[0]), "proto": parts[2],
                          "formats": tuple(parts[3:]), "connection": None, "attributes": []})
        elif kind == "c":
            if media:
                media[-1]["connection"] = _connection_address(value)
            else:
                session_connection = _connection_address(value)
        elif kind == "a":
            (media[-1]["attributes"] if media else session_attributes).append(_attribute(value))
        elif kind == "o":
            origin = value
    if not media:
        raise SdpError("SDP has no m= line")
    return SessionDescription(
        origin=origin,
        connection=session_connection,
        attributes=tuple(session_attributes),
        media=tuple(MediaDescription(m["media"], m["port"], m["proto"], m["formats"], m["connection"],
                                     tuple(m["attributes"])) for m in media),
    )


def check_offer(text: str) -> None:
    """Raise SdpError, with the reason a peer can read, unless the offer is SDP we could answer or
    decline cleanly: v=0 first (RFC 4566 §5), no NUL, and every active audio stream with a unicast
    address of its c= address type (§5.7), and ports we can send to: RTP below 65536 and an RTCP port
    (a=rtcp, RFC 3605, or RTP + 1, RFC 3550 §11) in 1-65535. Codecs are not judged here; a stream
    with port 0 is disabled (RFC 3264 §5.1) and is neither checked nor used."""
    if "\x00" in text:
        raise SdpError("NUL byte in SDP")
    first = text.lstrip("\r\n").split("\n", 1)[0].strip()
    if first != "v=0":
        raise SdpError(f"SDP must start with v=0, got {first[:20]!r}")
    offer = parse_sdp(text)
    lines = _connection_lines(text)
    for index, stream in enumerate(offer.media):
        if stream.media != "audio" or stream.port == 0:
            continue
        value = lines[index + 1] or lines[0]
        if value is None:
            raise SdpError("no c= line at session or media level for the audio stream")
        _check_address(value)
        rtcp_port(stream)


def _connection_lines(text: str) -> list[str | None]:
    """The c= value of the session (index 0) and of each m= section, as written."""
    found: list[str | None] = [None]
    for raw in text.replace("\r\n", "\n").split("\n"):
        line = raw.strip()
        if line.startswith("m="):
            found.append(None)
        elif line.startswith("c=") and found[-1] is None:
            found[-1] = line[2:]
    return found


def _check_address(value: str) -> None:
    _, family, address = value.split()
    host = address.split("/", 1)[0]
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise SdpError(f"c= address {host[:60]!r} is not an IP address") from None
    if (family, ip.version) not in (("IP4", 4), ("IP6", 6)):
        raise SdpError(f"c= address {host[:60]!r} does not match address type {family[:10]!r}")
    if ip.is_multicast:
        raise SdpError(f"c= address {host[:60]} is multicast; only unicast RTP is supported")


def rtcp_port(stream: MediaDescription) -> int:
    """Where the stream's RTCP goes: a=rtcp (RFC 3605 §2.1) or else the RTP port + 1 (RFC 3550 §11).
    Raises SdpError naming the attribute when that is no UDP port: a port we cannot send to must be
    refused here, before a socket is bound for the call, not discovered by the first RTCP report."""
    value = stream.attribute("rtcp")
    if value is None:
        if stream.port + 1 > 65535:
            raise SdpError(f"m={stream.media} port {stream.port} leaves no RTCP port (RTP port + 1, RFC 3550 §11); "
                           "add a=rtcp")
        return stream.port + 1
    port = value.split()[0] if value.split() else ""
    if not port.isdigit() or not 0 < int(port) <= 65535:
        raise SdpError(f"a=rtcp:{value[:40]}: port out of range 1-65535 (RFC 3605)")
    return int(port)


def _rtpmaps(stream: MediaDescription) -> dict[str, tuple[str, int]]:
    """Payload type -> (encoding name upper-cased, clock rate), static types included."""
    maps = {str(pt): codec for pt, codec in STATIC_PAYLOAD_TYPES.items()}
    for name, value in stream.attributes:
        if name == "rtpmap" and value:
            pt, _, encoding = value.partition(" ")
            parts = encoding.strip().split("/")
            if len(parts) >= 2 and parts[1].isdigit():
                maps[pt] = (parts[0].upper(), int(parts[1]))
    return maps


@dataclass
class _Choice:
    stream_index: int
    codec: str
    payload_type: int
    telephone_event_pt: int | None
    telephone_event_fmtp: str | None


def _choose(stream: MediaDescription, index: int, supported: tuple[str, ...], keep: str | None,
            order: CodecOrder) -> _Choice | None:
    maps = _rtpmaps(stream)
    offered = [(fmt, maps.get(fmt)) for fmt in stream.formats if fmt.isdigit()]
    ours = [(m[0], int(fmt)) for fmt, m in offered if m is not None and m[1] == RTP_CLOCK_RATE and m[0] in supported]
    if keep is not None:  # a re-offer: the playing prompt is buffered at the call's audio rate
        ours = [c for c in ours if CODECS[c[0]].audio_rate == CODECS[keep].audio_rate]
    if not ours:
        return None
    if order == "config":
        ours.sort(key=lambda c: supported.index(c[0]))
    codec_pt = next((c for c in ours if c[0] == keep), ours[0])  # the chosen order, current codec first
    te = next((int(fmt) for fmt, m in offered if m == ("TELEPHONE-EVENT", 8000)), None)
    te_fmtp = None
    if te is not None:
        te_fmtp = next((v.partition(" ")[2].strip() for k, v in stream.attributes
                        if k == "fmtp" and v and v.split(" ", 1)[0] == str(te)), None)
    return _Choice(index, codec_pt[0], codec_pt[1], te, te_fmtp)


@dataclass
class SdpAnswerer:
    """Answers the offers of one session (the initial INVITE and every re-INVITE/UPDATE after it)."""

    local_host: str
    local_port: int
    supported: tuple[str, ...] = ("PCMU", "PCMA", "G722")
    codec_order: CodecOrder = "offer"
    session_id: int = field(default_factory=lambda: random.getrandbits(62))
    _version: int = field(default=0, init=False)
    _last_body: str | None = field(default=None, init=False)
    _codec: str | None = field(default=None, init=False)

    def answer(self, offer_sdp: str) -> tuple[str, MediaPlan]:
        """The answer SDP and the media plan; raises NoCommonCodec (or SdpError) and then changes nothing."""
        offer = parse_sdp(offer_sdp)
        choice = self._choose_stream(offer)
        stream = offer.media[choice.stream_index]
        host = stream.connection or offer.connection
        if host is None:
            raise SdpError("no c= line at session or media level for the audio stream")
        offered_direction = next((name for name, _ in stream.attributes if name in DIRECTIONS),
                                 next((name for name, _ in offer.attributes if name in DIRECTIONS), "sendrecv"))
        direction = _ANSWER_DIRECTION[offered_direction]
        # c=0.0.0.0 is the pre-RFC 3264 way to put a call on hold (RFC 3264 §8.4): never send there.
        can_send = direction in ("sendrecv", "sendonly") and host not in ("0.0.0.0", "::")
        plan = MediaPlan(remote_host=host, remote_port=stream.port, codec=choice.codec,
                         payload_type=choice.payload_type, clock_rate=RTP_CLOCK_RATE,
                         telephone_event_pt=choice.telephone_event_pt, can_send=can_send, ptime=PTIME_MS,
                         direction=direction, remote_rtcp_port=rtcp_port(stream))
        body = self._body(offer, choice, direction)
        if body != self._last_body:
            self._version += 1 if self._last_body is not None else 0
            self._last_body = body
        self._codec = choice.codec
        return self._origin_line() + body, plan

    def _choose_stream(self, offer: SessionDescription) -> _Choice:
        for index, stream in enumerate(offer.media):
            if stream.media != "audio" or stream.port == 0 or stream.proto not in _RTP_PROFILES:
                continue
            choice = _choose(stream, index, self.supported, self._codec, self.codec_order)
            if choice is not None:
                return choice
        offered = [" ".join(m.formats) for m in offer.media if m.media == "audio" and m.port != 0]
        if not offered and any(m.media == "audio" for m in offer.media):
            # RFC 3264 §5.1/§8.2: port 0 disables a stream. A call with no audio has nothing for us to do;
            # on a re-offer the 488 keeps the session as it was (RFC 3261 §14.2).
            raise NoCommonCodec("every audio stream in the offer is disabled (port 0, RFC 3264 §5.1)")
        raise NoCommonCodec(f"offer has no usable audio stream with {'/'.join(self.supported)} "
                            f"(offered formats: {offered or 'none'})")

    def _origin_line(self) -> str:
        family = "IP6" if ":" in self.local_host else "IP4"
        return f"v=0\r\no=- {self.session_id} {self._version} IN {family} {self.local_host}\r\n"

    def _body(self, offer: SessionDescription, choice: _Choice, direction: str) -> str:
        family = "IP6" if ":" in self.local_host else "IP4"
        lines = ["s=-", f"c=IN {family} {self.local_host}", "t=0 0"]
        for index, stream in enumerate(offer.media):
            if index != choice.stream_index:
                # A rejected stream keeps its formats but port 0 (RFC 3264 §6).
                lines.append(f"m={stream.media} 0 {stream.proto} {' '.join(stream.formats)}")
                continue
            formats = [str(choice.payload_type)]
            if choice.telephone_event_pt is not None:
                formats.append(str(choice.telephone_event_pt))
            lines.append(f"m=audio {self.local_port} {stream.proto} {' '.join(formats)}")
            lines.append(f"a=rtpmap:{choice.payload_type} {choice.codec}/{RTP_CLOCK_RATE}")
            if choice.telephone_event_pt is not None:
                lines.append(f"a=rtpmap:{choice.telephone_event_pt} telephone-event/8000")
                lines.append(f"a=fmtp:{choice.telephone_event_pt} {choice.telephone_event_fmtp or '0-15'}")
            lines.append(f"a=ptime:{PTIME_MS}")
            lines.append(f"a={direction}")
        return "".join(line + "\r\n" for line in lines)
