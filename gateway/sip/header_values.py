"""The structured header values the gateway reads (RFC 3261 §20, §25): Via, SIP URIs, name-addr
(From/To/Contact/Route), CSeq, and comma-separated lists of them (§7.3.1).

Pure protocol code: each value parses from the text of one header value and prints back; a value
that does not parse raises `ValueError` naming it, which gateway/sip/message.py turns into a 400.
Nothing here knows about whole messages.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

# token (§25.1): methods, header names, parameter names.
TOKEN = re.compile(r"^[A-Za-z0-9\-.!%*_+`'~]+$")


def split_list(value: str) -> list[str]:
    """Split a comma-separated header value (§7.3.1), ignoring commas inside quotes and <...>."""
    items: list[str] = []
    current: list[str] = []
    in_quotes = in_angle = escaped = False
    for ch in value:
        if escaped:
            escaped = False
        elif in_quotes and ch == "\\":
            escaped = True
        elif ch == '"' and not in_angle:
            in_quotes = not in_quotes
        elif ch == "<" and not in_quotes:
            in_angle = True
        elif ch == ">" and not in_quotes:
            in_angle = False
        elif ch == "," and not in_quotes and not in_angle:
            items.append("".join(current).strip())
            current = []
            continue
        current.append(ch)
    items.append("".join(current).strip())
    return [item for item in items if item]


def parse_cseq(value: str) -> tuple[int, str]:
    parts = value.split()
    if len(parts) != 2 or not parts[0].isdigit() or not TOKEN.match(parts[1]):
        raise ValueError(f"bad CSeq {value!r}")
    number = int(parts[0])
    if number >= 2**31:  # §8.1.1.5: the sequence number MUST be less than 2**31
        raise ValueError(f"CSeq number out of range: {number}")
    return number, parts[1]


@dataclass(frozen=True)
class Via:
    """One Via value (§20.42): `SIP/2.0/UDP host:port;branch=...;received=...;rport`."""

    transport: str
    host: str
    port: int | None
    params: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def parse(cls, value: str) -> Via:
        match = re.match(r"^\s*SIP\s*/\s*2\.0\s*/\s*([A-Za-z0-9\-]+)\s+(.*)$", value, re.DOTALL)
        if not match:
            raise ValueError(f"bad Via {value!r}")
        transport, rest = match.group(1).upper(), match.group(2)
        sent_by, *raw_params = [part.strip() for part in rest.split(";")]
        host, port = _split_host_port(sent_by)
        params = []
        for raw in raw_params:
            name, sep, val = raw.partition("=")
            params.append((name.strip().lower(), val.strip() if sep else None))
        return cls(transport, host, port, tuple(params))

    def param(self, name: str) -> str | None:
        return next((v for k, v in self.params if k == name), None)

    def has_param(self, name: str) -> bool:
        return any(k == name for k, _ in self.params)

    @property
    def branch(self) -> str | None:
        return self.param("branch")

    @property
    def sent_by(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port is None else f"{host}:{self.port}"

    def with_param(self, name: str, value: str | None) -> Via:
        params = [(k, value if k == name else v) for k, v in self.params]
        if not self.has_param(name):
            params.append((name, value))
        return replace(self, params=tuple(params))

    def __str__(self) -> str:
        params = "".join(f";{k}" if v is None else f";{k}={v}" for k, v in self.params)
        return f"SIP/2.0/{self.transport} {self.sent_by}{params}"


def _split_host_port(text: str) -> tuple[str, int | None]:
    text = text.strip()
    if text.startswith("["):  # IPv6 reference (§25.1)
        end = text.find("]")
        if end < 0:
            raise ValueError(f"bad host {text!r}")
        host, rest = text[1:end], text[end + 1:]
    else:
        host, _, port_text = text.partition(":")
        rest = f":{port_text}" if port_text else ""
    if not host or any(ch.isspace() for ch in host):
        raise ValueError(f"bad host {text!r}")
    if not rest:
        return host, None
    if not rest.startswith(":") or not rest[1:].isdigit() or not 0 < int(rest[1:]) < 65536:
        raise ValueError(f"bad port in {text!r}")
    return host, int(rest[1:])


@dataclass(frozen=True)
class SipUri:
    """The parts of a sip:/sips: URI (§19.1.1) the gateway needs: user, host, port, parameters."""

    scheme: str
    user: str
    host: str
    port: int | None
    params: tuple[tuple[str, str | None], ...] = ()

    @classmethod
    def parse(cls, uri: str) -> SipUri:
        scheme, sep, rest = uri.strip().partition(":")
        if not sep or scheme.lower() not in ("sip", "sips"):
            raise ValueError(f"not a SIP URI: {uri!r}")
        rest = rest.split("?", 1)[0]
        userinfo, at, hostpart = rest.rpartition("@")
        user = userinfo.split(":", 1)[0] if at else ""
        hostport, *raw_params = hostpart.split(";")
        host, port = _split_host_port(hostport)
        params = []
        for raw in raw_params:
            name, eq, value = raw.partition("=")
            params.append((name.lower(), value if eq else None))
        return cls(scheme.lower(), user, host, port, tuple(params))

    def param(self, name: str) -> str | None:
        return next((v for k, v in self.params if k == name), None)

    def has_param(self, name: str) -> bool:
        return any(k == name for k, _ in self.params)


@dataclass(frozen=True)
class NameAddr:
    """A From/To/Contact/Route value (§20.10): optional display name, URI, header parameters."""

    uri: str
    display: str = ""
    params: tuple[tuple[str, str | None], ...] = field(default=())

    @classmethod
    def parse(cls, value: str) -> NameAddr:
        value = value.strip()
        if "<" in value:
            start, end = value.index("<"), value.find(">")
            if end < start:
                raise ValueError(f"unterminated <...> in {value!r}")
            display, uri, tail = value[:start].strip(), value[start + 1:end].strip(), value[end + 1:]
        else:  # addr-spec form: parameters after the URI belong to the header (§20.10)
            uri, _, rest = value.partition(";")
            display, tail = "", f";{rest}" if rest else ""
        params = []
        for raw in tail.split(";")[1:]:
            name, eq, val = raw.partition("=")
            params.append((name.strip().lower(), val.strip() if eq else None))
        return cls(uri.strip(), display, tuple(params))

    @property
    def tag(self) -> str | None:
        return next((v for k, v in self.params if k == "tag"), None)
