"""SIP messages as values: parse bytes into a request or response, serialise back to bytes.

Pure protocol code (RFC 3261 §7, §20, §25): no sockets, no clocks. Header names are matched
case-insensitively and compact forms are expanded for lookup (§7.3.3) while the name as written is
kept, so `serialize()` reproduces a canonical message byte for byte. Header values are decoded as
UTF-8 (§25.1 allows UTF-8 TEXT); invalid bytes survive a round trip via surrogate escapes.

A message that fails to parse raises `ParseError` with a reason and, where the header section could
be read, the partial message, so the server can still answer 400 (§21.4.1) using its Via/From/To/
Call-ID/CSeq. The structured values inside headers (Via, URIs, name-addr, CSeq) are parsed in
gateway/sip/header_values.py.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Self

from gateway.sip.header_values import (
    TOKEN,
    NameAddr,
    SipUri,
    Via,
    parse_cseq,
    split_list,
)

SIP_VERSION = "SIP/2.0"

# §7.3.3 and the IANA registry of compact forms.
COMPACT_FORMS = {
    "a": "Accept-Contact", "b": "Referred-By", "c": "Content-Type", "d": "Request-Disposition",
    "e": "Content-Encoding", "f": "From", "i": "Call-ID", "j": "Reject-Contact", "k": "Supported",
    "l": "Content-Length", "m": "Contact", "n": "Identity-Info", "o": "Event", "r": "Refer-To",
    "s": "Subject", "t": "To", "u": "Allow-Events", "v": "Via", "x": "Session-Expires", "y": "Identity",
}

# Bounds on what a peer chooses and every log line and metric downstream repeats. Real ones are far
# shorter (Call-IDs of 20-80 characters, URIs under 200); RFC 3261 sets no limit, §21.4.12 has a code.
MAX_CALL_ID_CHARS = 256
MAX_REQUEST_URI_CHARS = 1024
MAX_FORWARDS_LIMIT = 255  # §20.22
# §20.42 transport values: RFC 3261's, TLS-SCTP (RFC 4168) and WebSocket (RFC 7118).
VIA_TRANSPORTS = ("UDP", "TCP", "TLS", "SCTP", "TLS-SCTP", "WS", "WSS")

_ENCODING = "utf-8"
_ERRORS = "surrogateescape"


class ParseError(ValueError):
    """The bytes are not a SIP message we can process; `partial` holds what could be read."""

    def __init__(self, reason: str, partial: SipRequest | SipResponse | None = None, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.partial = partial
        self.status = status  # 400; 414 for a Request-URI too long; 505 for another SIP version (§21.5.6)


def canonical_name(name: str) -> str:
    """The lower-case long form used for matching (`v` and `VIA` both become `via`)."""
    lowered = name.strip().lower()
    return COMPACT_FORMS.get(lowered, lowered).lower()


@dataclass(frozen=True)
class _Message:
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def header(self, name: str) -> str | None:
        """The value of the first header line called `name` (any case, compact or long), or None."""
        wanted = canonical_name(name)
        for key, value in self.headers:
            if canonical_name(key) == wanted:
                return value
        return None

    def header_lines(self, name: str) -> list[str]:
        wanted = canonical_name(name)
        return [value for key, value in self.headers if canonical_name(key) == wanted]

    def header_values(self, name: str) -> list[str]:
        """All values of a list header (Via, Route, Record-Route, ...) across lines, in order."""
        return [item for line in self.header_lines(name) for item in split_list(line)]

    def with_header(self, name: str, value: str) -> Self:
        """A copy with the first `name` header replaced (or appended if absent)."""
        wanted = canonical_name(name)
        headers = list(self.headers)
        for i, (key, _) in enumerate(headers):
            if canonical_name(key) == wanted:
                headers[i] = (key, value)
                return replace(self, headers=tuple(headers))
        return replace(self, headers=(*headers, (name, value)))

    def without_header(self, name: str) -> Self:
        wanted = canonical_name(name)
        return replace(self, headers=tuple(h for h in self.headers if canonical_name(h[0]) != wanted))

    def with_body(self, body: bytes, content_type: str | None) -> Self:
        message = self.without_header("Content-Type").without_header("Content-Length")
        headers = list(message.headers)
        if content_type is not None and body:
            headers.append(("Content-Type", content_type))
        headers.append(("Content-Length", str(len(body))))
        return replace(message, headers=tuple(headers), body=body)

    def with_vias(self, vias: list[Via]) -> Self:
        """A copy whose Via values are `vias`, one per line, where the first Via line stood."""
        wanted = canonical_name("Via")
        first = next((i for i, (key, _) in enumerate(self.headers) if canonical_name(key) == wanted), 0)
        rest = [h for h in self.headers if canonical_name(h[0]) != wanted]
        before = [h for h in self.headers[:first] if canonical_name(h[0]) != wanted]
        after = rest[len(before):]
        return replace(self, headers=(*before, *(("Via", str(v)) for v in vias), *after))

    @property
    def call_id(self) -> str | None:
        return self.header("Call-ID")

    @property
    def cseq(self) -> tuple[int, str]:
        """(sequence number, method) of the CSeq header; the parser guarantees it is well formed."""
        return parse_cseq(self.header("CSeq") or "")

    @property
    def vias(self) -> list[Via]:
        return [Via.parse(value) for value in self.header_values("Via")]

    @property
    def from_tag(self) -> str | None:
        value = self.header("From")
        return NameAddr.parse(value).tag if value else None

    @property
    def to_tag(self) -> str | None:
        value = self.header("To")
        return NameAddr.parse(value).tag if value else None

    def _serialize(self, start_line: str) -> bytes:
        lines = [start_line]
        lines.extend(f"{name}: {value}" for name, value in self.headers)
        if self.header("Content-Length") is None:
            lines.append(f"Content-Length: {len(self.body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode(_ENCODING, _ERRORS) + self.body


@dataclass(frozen=True)
class SipRequest(_Message):
    method: str = ""
    uri: str = ""

    def serialize(self) -> bytes:
        return self._serialize(f"{self.method} {self.uri} {SIP_VERSION}")

    @property
    def request_user(self) -> str:
        return SipUri.parse(self.uri).user


@dataclass(frozen=True)
class SipResponse(_Message):
    status: int = 0
    reason: str = ""

    def serialize(self) -> bytes:
        return self._serialize(f"{SIP_VERSION} {self.status} {self.reason}")


def content_length_of(header_block: str) -> int | None:
    """The Content-Length named in a header block (stream framing, §18.3); None if absent."""
    lengths = {line.partition(":")[2].strip() for line in header_block.split("\r\n")[1:]
               if ":" in line and canonical_name(line.partition(":")[0]) == "content-length"}
    return _one_length(lengths)


def _one_length(values: set[str]) -> int | None:
    """Content-Length given once (or repeated identically). Two different values leave the message
    boundary to whoever reads it: request smuggling, so refuse (RFC 7230 §3.3.3 reasons the same)."""
    if not values:
        return None
    if len(values) > 1:
        raise ParseError(f"conflicting Content-Length headers {sorted(values)!r}"[:120])
    value = values.pop()
    if not value.isdigit() or len(value) > 10:
        raise ParseError(f"bad Content-Length {value[:20]!r}")
    return int(value)


def parse(data: bytes, *, stream: bool = False) -> SipRequest | SipResponse:
    """Parse one message. `stream=True` (TCP) requires Content-Length (§18.3); over UDP a missing
    Content-Length means "the rest of the datagram" and bytes beyond it are discarded (§18.3)."""
    head, sep, body = data.partition(b"\r\n\r\n")
    if not sep:
        head, sep, body = data.partition(b"\n\n")  # tolerate bare-LF peers
    if not sep:
        raise ParseError("no blank line after headers")
    text = head.decode(_ENCODING, _ERRORS).replace("\r\n", "\n")
    lines = text.lstrip("\n").split("\n")
    start_line, header_lines = lines[0], lines[1:]
    message, version_error = _parse_start_line(start_line)
    headers, bad_line = _parse_headers(header_lines)
    message = replace(message, headers=headers)
    try:
        if version_error is not None:
            raise version_error
        if isinstance(message, SipRequest) and len(message.uri) > MAX_REQUEST_URI_CHARS:
            raise ParseError(f"Request-URI longer than {MAX_REQUEST_URI_CHARS} characters", status=414)
        if bad_line is not None:
            raise ParseError(f"bad header line {bad_line[:80]!r}")
        if "\x00" in text:
            # A raw NUL is no part of any SIP token or TEXT-UTF8 (§25.1); C code downstream would
            # read the value cut short at it. Escaped %00 in a URI stays legal (RFC 4475 §3.1.1.6).
            raise ParseError("NUL byte in the header section")
        length = _one_length({value.strip() for value in message.header_lines("Content-Length")})
        if length is None:
            if stream:
                raise ParseError("Content-Length required on a stream transport", message)
            length = len(body)
        if length > len(body):
            raise ParseError(f"Content-Length {length} exceeds body of {len(body)} bytes", message)
        message = replace(message, body=body[:length])
        _validate(message)
    except ParseError as exc:
        if exc.partial is None:
            exc.partial = message
        raise
    return message


def _parse_start_line(line: str) -> tuple[SipRequest | SipResponse, ParseError | None]:
    """The start line, and a version error to raise once the headers are read (so the 505 can be sent)."""
    if line.startswith("SIP/"):
        parts = line.split(" ", 2)
        if len(parts) < 2 or parts[0] != SIP_VERSION or not parts[1].isdigit() or len(parts[1]) != 3:
            raise ParseError(f"bad status line {line[:80]!r}")
        return SipResponse(status=int(parts[1]), reason=parts[2] if len(parts) > 2 else ""), None
    # §7.1: Method SP Request-URI SP SIP-Version, single spaces, no whitespace inside the URI.
    parts = line.split(" ")
    if len(parts) != 3 or not TOKEN.match(parts[0]) or not parts[1]:
        raise ParseError(f"bad request line {line[:80]!r}")
    if ":" not in parts[1]:
        raise ParseError(f"bad Request-URI {parts[1][:80]!r}")
    request = SipRequest(method=parts[0], uri=parts[1])
    if parts[2].upper() != SIP_VERSION:  # §7.1: the version is case-insensitive
        if re.fullmatch(r"SIP/\d+\.\d+", parts[2], re.IGNORECASE):
            return request, ParseError(f"unsupported version {parts[2][:20]!r}", status=505)
        raise ParseError(f"bad SIP version {parts[2][:20]!r}")
    return request, None


def _parse_headers(lines: list[str]) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """Header lines, unfolded; also the first unparseable line, which is skipped so the rest
    (Via, Call-ID, ...) can still serve a 400 response."""
    headers: list[tuple[str, str]] = []
    bad_line: str | None = None
    for line in lines:
        if line[:1] in (" ", "\t"):  # §7.3.1 line folding: continuation of the previous value
            if headers:
                name, value = headers[-1]
                headers[-1] = (name, f"{value} {line.strip()}".strip())
            elif bad_line is None:
                bad_line = line
            continue
        name, sep, value = line.partition(":")
        name = name.strip()
        if not sep or not TOKEN.match(name):
            bad_line = line if bad_line is None else bad_line
            continue
        headers.append((name, value.strip()))
    return tuple(headers), bad_line


def _validate(message: SipRequest | SipResponse) -> None:
    """Mandatory headers (§8.1.1) and the fields the transaction layer relies on."""
    for name in ("Via", "From", "To", "Call-ID", "CSeq"):
        if message.header(name) is None:
            raise ParseError(f"missing {name}")
    if len(message.call_id or "") > MAX_CALL_ID_CHARS:
        raise ParseError(f"Call-ID longer than {MAX_CALL_ID_CHARS} characters")
    try:
        if not message.vias:
            raise ValueError("empty Via")
        NameAddr.parse(message.header("From") or "")
        NameAddr.parse(message.header("To") or "")
        _, cseq_method = message.cseq
    except ValueError as exc:
        raise ParseError(str(exc)) from None
    if message.vias[0].transport not in VIA_TRANSPORTS:
        # §18.2.2 sends the response by the top Via's transport: one we do not know names no way back.
        raise ParseError(f"Via transport {message.vias[0].transport[:20]!r} is not a SIP transport "
                         f"({', '.join(VIA_TRANSPORTS)})")
    if isinstance(message, SipRequest):
        if cseq_method != message.method:  # RFC 4475 torture test mismatch01
            raise ParseError(f"CSeq method {cseq_method} does not match {message.method}")
        max_forwards = (message.header("Max-Forwards") or "0").strip()
        # §25: 1*DIGIT; §20.22: "an integer in the range 0-255". More is no hop count but a probe.
        significant = max_forwards.lstrip("0")  # leading zeros are legal (RFC 4475 §3.1.1.1: 0068)
        if not max_forwards.isdigit() or len(significant) > 3 or int(significant or "0") > MAX_FORWARDS_LIMIT:
            raise ParseError(f"bad Max-Forwards {max_forwards[:24]!r}: expected 0-{MAX_FORWARDS_LIMIT} (RFC 3261 §20.22)")
        if message.uri[:4].lower() in ("sip:", "sips"):
            try:  # §19.1.1: a port is 1*DIGIT, and a UDP/TCP port is below 65536
                SipUri.parse(message.uri)
            except ValueError as exc:
                raise ParseError(f"bad Request-URI: {exc}"[:160]) from None


def make_response(request: SipRequest, status: int, reason: str, *, to_tag: str | None = None,
                  headers: tuple[tuple[str, str], ...] = (), body: bytes = b"",
                  content_type: str | None = None) -> SipResponse:
    """A response to `request` (§8.2.6.2): Via (all, in order), From, To, Call-ID and CSeq copied;
    the To tag added unless the request already had one."""
    copied: list[tuple[str, str]] = [("Via", value) for value in request.header_values("Via")]
    for name in ("From", "To", "Call-ID", "CSeq"):
        value = request.header(name)
        if value is None:
            continue
        if name == "To" and to_tag is not None and _to_tag_of(value) is None:
            value = f"{value};tag={to_tag}"
        copied.append((name, value))
    response = SipResponse(status=status, reason=reason, headers=(*copied, *headers))
    return response.with_body(body, content_type)


def _to_tag_of(value: str) -> str | None:
    try:
        return NameAddr.parse(value).tag
    except ValueError:
        return None
