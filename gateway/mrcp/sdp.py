"""The MRCPv2 part of SDP offer/answer (RFC 6787 §4.2, with RFC 4145 setup/connection): which offer asks
for a synthesizer channel, and our answer's control stream spliced into the audio answer.

An offer carries one `m=application 9 TCP/MRCPv2 1` (or TCP/TLS/MRCPv2) per resource, with `a=setup:active`,
`a=connection:new|existing`, `a=resource:speechsynth` and `a=cmid:<mid>` naming the audio stream's `a=mid`.
We answer the first speechsynth stream with our port, `a=setup:passive`, the offered connection kind, and
`a=channel:<id>@speechsynth`; every other application stream is declined with port 0 (RFC 3264 §6). The audio
stream is answered by media/sdp.py as for any call, and gets its `a=mid` back. No sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from gateway.media.sdp import SdpError, SessionDescription, parse_sdp

MRCP_PROTOS = ("TCP/MRCPv2", "TCP/TLS/MRCPv2")
SYNTHESIZER = "speechsynth"


class MrcpOfferError(ValueError):
    """The offer asks for MRCP but not in a way we can answer (the session answers 488 with this reason)."""


@dataclass(frozen=True)
class ControlOffer:
    index: int  # of the m= line within the offer
    proto: str
    connection: str  # "new" | "existing"
    cmid: str | None
    audio_mid: str | None  # the a=mid of the audio stream cmid names (or of the first audio stream)


def is_mrcp_offer(sdp: str | None) -> bool:
    """Whether an INVITE's SDP opens an MRCPv2 session (an active m=application TCP/MRCPv2 line)."""
    if not sdp:
        return False
    try:
        offer = parse_sdp(sdp)
    except SdpError:
        return False
    return any(m.media == "application" and m.proto in MRCP_PROTOS for m in offer.media)


def synthesizer_offer(sdp: str, tls_available: bool) -> ControlOffer:
    """The control stream we answer; raises MrcpOfferError naming what is missing."""
    offer = parse_sdp(sdp)
    streams = [(i, m) for i, m in enumerate(offer.media) if m.media == "application" and m.proto in MRCP_PROTOS
               and m.port != 0]
    synth = next(((i, m) for i, m in streams if (m.attribute("resource") or "").lower() == SYNTHESIZER), None)
    if synth is None:
        resources = ", ".join(sorted({m.attribute("resource") or "none" for _, m in streams})) or "none"
        raise MrcpOfferError(f"no a=resource:{SYNTHESIZER} control stream (offered: {resources[:60]}); "
                             "this server has only the synthesizer")
    index, stream = synth
    if stream.proto == "TCP/TLS/MRCPv2" and not tls_available:
        raise MrcpOfferError("TCP/TLS/MRCPv2 offered but mrcp.tls is not configured")
    setup = (stream.attribute("setup") or "active").lower()
    if setup not in ("active", "actpass"):  # RFC 4145 §4: the client connects, we listen
        raise MrcpOfferError(f"a=setup:{setup[:20]}: the client must connect (active), RFC 6787 §4.2")
    connection = (stream.attribute("connection") or "new").lower()
    if connection not in ("new", "existing"):
        raise MrcpOfferError(f"a=connection:{connection[:20]}: expected new or existing (RFC 4145 §5)")
    cmid = stream.attribute("cmid")
    return ControlOffer(index, stream.proto, connection, cmid, _audio_mid(offer, cmid))


def _audio_mid(offer: SessionDescription, cmid: str | None) -> str | None:
    mids = [m.attribute("mid") for m in offer.media if m.media == "audio" and m.port != 0]
    if cmid is not None and cmid in mids:
        return cmid
    return next((mid for mid in mids if mid is not None), None)


def answer_with_control(audio_answer: str, control: ControlOffer, port: int, channel: str) -> str:
    """`audio_answer` (media/sdp.py's, where the application stream is declined with port 0) with our
    control stream in that m= line's place and the audio stream's `a=mid` restored."""
    sections = _sections(audio_answer)
    head, media = sections[0], sections[1:]
    lines = [f"m=application {port} {control.proto} 1", "a=setup:passive", f"a=connection:{control.connection}",
             f"a=channel:{channel}@{SYNTHESIZER}"]
    if control.cmid is not None:
        lines.append(f"a=cmid:{control.cmid}")
    media[control.index] = "".join(line + "\r\n" for line in lines)
    if control.audio_mid is not None:
        for index, section in enumerate(media):
            if section.startswith("m=audio ") and not section.startswith("m=audio 0 "):
                media[index] = section + f"a=mid:{control.audio_mid}\r\n"
                break
    return head + "".join(media)


def _sections(sdp: str) -> list[str]:
    """The session part, then one string per m= section, each with its CRLFs."""
    sections = [""]
    for line in sdp.split("\r\n")[:-1]:
        if line.startswith("m="):
            sections.append("")
        sections[-1] += line + "\r\n"
    return sections
