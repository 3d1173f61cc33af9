"""The replies the SIP server builds at its edge, before a request has a transaction, and where any
response goes.

- Where a response goes: the top Via stamped with `received`/`rport` (§18.2.1, RFC 3581 §4), and
  the address a response is sent to (§18.2.2, RFC 3581 §4).
- A message that does not parse or frame: 400, 413, 414 (§21.4.12) or 505 (§21.5.6) with the reason
  in a Warning (§20.43), when the request names where a response goes (§21.4.1); else nothing.
- Before parsing (a flood, or a source outside the allow-list): a 503 (§21.5.4) or 403 built from the
  raw header lines.

Pure protocol code: no sockets, no clocks; gateway/sip/uas.py decides when each applies and sends.
"""

from __future__ import annotations

import re

from gateway.sip.dialog import new_tag
from gateway.sip.message import SipRequest, SipResponse, canonical_name, make_response

_REASONS = {413: "Request Entity Too Large", 414: "Request-URI Too Long", 505: "Version Not Supported"}
_CHEAP_HEADERS = frozenset({"via", "from", "to", "call-id", "cseq"})
_CSEQ = re.compile(rb"[ \t]*\d{1,10}[ \t]+[A-Za-z]{1,32}[ \t]*")


def warning(user_agent: str, text: str) -> tuple[str, str]:
    """A Warning header (§20.43, code 399: miscellaneous) carrying `text` for the peer's logs."""
    return "Warning", f'399 {user_agent} "{_quoted(text)}"'


def _quoted(text: str) -> str:
    """Text safe inside a Warning's quoted-string (§20.43): no quotes, backslashes or control bytes."""
    return "".join(ch if ch.isprintable() and ch not in '"\\' else "?" for ch in text[:120])


def stamp_via(request: SipRequest, source: tuple[str, int]) -> SipRequest:
    """§18.2.1 `received` when the sent-by host is not the source IP; RFC 3581 §4 fills `rport`."""
    vias = request.vias
    top = vias[0]
    source_ip, source_port = source
    if top.has_param("rport"):
        top = top.with_param("rport", str(source_port)).with_param("received", source_ip)
    elif top.host != source_ip:
        top = top.with_param("received", source_ip)
    else:
        return request
    return request.with_vias([top, *vias[1:]])


def response_address(response: SipResponse, reliable: bool) -> tuple[str, int]:
    """§18.2.2: `received` (or sent-by) at the `rport` port (RFC 3581 §4, unreliable transports
    only) or the sent-by port, 5060 when none is given."""
    via = response.vias[0]
    host = via.param("received") or via.host
    rport = via.param("rport")
    if not reliable and rport and rport.isdigit():
        return host, int(rport)
    return host, via.port or 5060


def malformed_reply(request: SipRequest | SipResponse | None, source: tuple[str, int], status: int,
                    detail: str, user_agent: str) -> SipResponse | None:
    """The answer to a request that could be read only in part (§21.4.1), or None when it names no
    usable Via or is an ACK (an ACK is never answered)."""
    if not isinstance(request, SipRequest) or request.method in ("", "ACK"):
        return None
    try:
        request = stamp_via(request, source)
    except (ValueError, IndexError):
        return None
    return make_response(request, status, _REASONS.get(status, "Bad Request"), to_tag=new_tag(),
                         headers=(warning(user_agent, detail),))


def cheap_reply(data: bytes, status: int, reason: str, extra: tuple[str, ...] = ()) -> bytes | None:
    """A response built from the raw header lines of `data` (Via, From, To, Call-ID, CSeq copied as written;
    §8.2.6.2: a To tag added when there is none), or None when they are not all there or the CSeq is not
    a number and a method. The caller sends it
    to the source address only: a forged Via must not turn us into an amplifier."""
    head = data[:8192].split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
    copied = []
    for line in head:
        name = canonical_name(line.split(b":", 1)[0].decode("latin-1"))
        if name in _CHEAP_HEADERS:
            if name == "to" and b";tag=" not in line.lower():
                line += b";tag=" + new_tag().encode()
            elif name == "cseq" and _CSEQ.fullmatch(line.split(b":", 1)[-1]) is None:
                return None  # a response the peer could not match to its request is worth nothing
            copied.append(line)
    if len(copied) < 5:
        return None
    return b"\r\n".join([f"SIP/2.0 {status} {reason}".encode(), *copied, *(line.encode() for line in extra),
                         b"Content-Length: 0", b"", b""])
