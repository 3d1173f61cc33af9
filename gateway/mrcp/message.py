"""MRCPv2 messages (RFC 6787 §5): parse one from the front of a byte stream, serialize ours.

Three kinds share one framing, a start-line whose second field is the whole message's length in octets
(start-line, headers and body; §5.1):

    request:  MRCP/2.0 SP message-length SP method-name SP request-id CRLF          (§5.2)
    response: MRCP/2.0 SP message-length SP request-id SP status-code SP request-state CRLF   (§5.3)
    event:    MRCP/2.0 SP message-length SP event-name SP request-id SP request-state CRLF    (§5.5)

then `Name: value` header lines (RFC 5322 style; folded lines are joined), an empty line, and a body of
Content-Length octets. Only requests come to a server; `read_request` frames and parses one, raising
`MessageError` with the §5.4 status a response should carry (and whether the stream can still be framed).
Pure: no sockets, no clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

VERSION = "MRCP/2.0"
REQUEST_STATES = ("COMPLETE", "IN-PROGRESS", "PENDING")
_MAX_REQUEST_ID = 2**32 - 1  # request-id = 1*10DIGIT, a 32-bit unsigned range (§5.1)
_MAX_START_LINE = 512

# §5.4 status codes (the 4xx/5xx a server sends for a request it cannot carry out).
SUCCESS = 200
SUCCESS_WITH_IGNORE = 201
METHOD_NOT_ALLOWED = 401
METHOD_NOT_VALID_IN_STATE = 402
UNSUPPORTED_HEADER = 403
ILLEGAL_HEADER_VALUE = 404
RESOURCE_NOT_ALLOCATED = 405
MANDATORY_HEADER_MISSING = 406
METHOD_FAILED = 407
UNRECOGNIZED_MESSAGE = 408
UNSUPPORTED_HEADER_VALUE = 409
OUT_OF_ORDER = 410
SERVER_ERROR = 501
VERSION_NOT_SUPPORTED = 502
MESSAGE_TOO_LARGE = 504


class MessageError(ValueError):
    """A request that cannot be carried out as sent. `status` is its §5.4 code, `request_id` what the
    response names (0 when the start line did not give one), `length` how many bytes the message took
    (None: the stream cannot be framed any further, so the connection must close)."""

    def __init__(self, status: int, reason: str, request_id: int = 0, length: int | None = None,
                 channel: str | None = None) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.request_id = request_id
        self.length = length
        self.channel = channel


@dataclass(frozen=True)
class Headers:
    """Header fields in arrival order; names compare case-insensitively (§6)."""

    items: tuple[tuple[str, str], ...] = ()

    def get(self, name: str) -> str | None:
        wanted = name.lower()
        return next((value for key, value in self.items if key.lower() == wanted), None)

    def names(self) -> tuple[str, ...]:
        return tuple(key for key, _ in self.items)


@dataclass(frozen=True)
class MrcpRequest:
    method: str
    request_id: int
    headers: Headers = field(default_factory=Headers)
    body: bytes = b""

    @property
    def channel(self) -> str | None:
        return self.headers.get("Channel-Identifier")


@dataclass(frozen=True)
class MrcpResponse:
    request_id: int
    status: int
    state: str  # COMPLETE | IN-PROGRESS | PENDING
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def serialize(self) -> bytes:
        return _frame(lambda length: f"{VERSION} {length} {self.request_id} {self.status} {self.state}",
                      self.headers, self.body)


@dataclass(frozen=True)
class MrcpEvent:
    name: str  # SPEAK-COMPLETE | SPEECH-MARKER
    request_id: int
    state: str  # IN-PROGRESS, or COMPLETE for the request's last event
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""

    def serialize(self) -> bytes:
        return _frame(lambda length: f"{VERSION} {length} {self.name} {self.request_id} {self.state}",
                      self.headers, self.body)


def _frame(start_line, headers: tuple[tuple[str, str], ...], body: bytes) -> bytes:
    """The message bytes; message-length counts its own digits (§5.1), so settle it by trying."""
    fields = list(headers)
    if body:
        fields.append(("Content-Length", str(len(body))))
    rest = "".join(f"{name}: {value}\r\n" for name, value in fields).encode() + b"\r\n" + body
    length = len(rest) + len(start_line(0)) + 2
    while len(start_line(length)) + 2 + len(rest) != length:  # at most twice: one more digit
        length = len(start_line(length)) + 2 + len(rest)
    return start_line(length).encode() + b"\r\n" + rest


def read_request(data: bytes | bytearray, max_bytes: int) -> tuple[MrcpRequest, int] | None:
    """The request at the front of `data` and the bytes it took, or None while it is incomplete.
    Raises MessageError for what cannot be taken."""
    end = data.find(b"\r\n")
    if end < 0:
        if len(data) > _MAX_START_LINE:
            raise MessageError(UNRECOGNIZED_MESSAGE, "no start line within 512 bytes")
        return None
    line = bytes(data[:end]).decode("ascii", "replace")
    parts = line.split(" ")
    if len(parts) != 4 or not parts[0].startswith("MRCP/"):
        request_id = int(parts[-1]) if parts[-1].isdigit() and len(parts[-1]) <= 10 else 0
        raise MessageError(UNRECOGNIZED_MESSAGE, f"bad start line {line[:80]!r}: expected "
                                                 "'MRCP/2.0 length method request-id'", request_id)
    version, length_text, method, id_text = parts
    if not length_text.isdigit() or len(length_text) > 10:
        raise MessageError(UNRECOGNIZED_MESSAGE, f"message-length {length_text[:20]!r} is not a number")
    length = int(length_text)
    request_id = int(id_text) if id_text.isdigit() and len(id_text) <= 10 else 0
    if length < end + 4:  # the start line, its CRLF and the empty line at least
        raise MessageError(UNRECOGNIZED_MESSAGE, f"message-length {length} is shorter than the start line",
                           request_id)
    if length > max_bytes:
        raise MessageError(MESSAGE_TOO_LARGE, f"message-length {length} exceeds {max_bytes} bytes", request_id)
    if len(data) < length:
        return None
    message = bytes(data[:length])
    if version != VERSION:
        raise MessageError(VERSION_NOT_SUPPORTED, f"version {version[:20]!r} is not {VERSION}", request_id, length)
    if not id_text.isdigit() or len(id_text) > 10 or int(id_text) > _MAX_REQUEST_ID:
        raise MessageError(UNRECOGNIZED_MESSAGE, f"request-id {id_text[:20]!r} is not a 32-bit number", 0, length)
    if not method.isascii() or not method.replace("-", "").isalpha():
        raise MessageError(UNRECOGNIZED_MESSAGE, f"method {method[:20]!r} is not a token", request_id, length)
    head_end = message.find(b"\r\n\r\n", end)
    if head_end < 0:
        raise MessageError(UNRECOGNIZED_MESSAGE, "no empty line ends the headers within message-length",
                           request_id, length)
    headers = _headers(message[end + 2: head_end], request_id, length)
    body = message[head_end + 4:]
    declared = headers.get("Content-Length")
    channel = headers.get("Channel-Identifier")
    if declared is None and body:
        raise MessageError(UNRECOGNIZED_MESSAGE, f"{len(body)} body bytes without Content-Length",
                           request_id, length, channel)
    if declared is not None and (not declared.strip().isdigit() or int(declared) != len(body)):
        raise MessageError(UNRECOGNIZED_MESSAGE, f"Content-Length {declared[:20]!r} does not match the "
                                                 f"{len(body)} body bytes that message-length leaves",
                           request_id, length, channel)
    return MrcpRequest(method, request_id, headers, body), length


def _headers(block: bytes, request_id: int, length: int) -> Headers:
    try:
        text = block.decode("utf-8")
    except UnicodeDecodeError:
        raise MessageError(UNRECOGNIZED_MESSAGE, "header block is not UTF-8", request_id, length) from None
    items: list[tuple[str, str]] = []
    for raw in text.split("\r\n") if text else ():
        if raw[:1] in (" ", "\t") and items:  # a folded continuation line
            name, value = items[-1]
            items[-1] = (name, f"{value} {raw.strip()}")
            continue
        name, sep, value = raw.partition(":")
        if not sep or not name or name != name.strip() or not name.replace("-", "").isalnum():
            raise MessageError(UNRECOGNIZED_MESSAGE, f"bad header line {raw[:60]!r}", request_id, length)
        items.append((name, value.strip()))
    return Headers(tuple(items))
