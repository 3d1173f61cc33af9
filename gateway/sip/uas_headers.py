"""What the UAS says about itself and reads from a request's headers and body, as pure values: the methods we
Allow and extensions we support (RFC 3261 §20.5, §20.37) or lack (§8.2.2.3: 420), our Contact URI (§8.1.1.8),
the Request-URI's user, and whether a body is an SDP offer we can take (RFC 3264; 415/488 otherwise).

Pure protocol code: no sockets, no clocks, no dialog state. inbound_call.py and uas.py build their responses
with these; the SDP itself is checked by gateway/media/sdp.py.
"""

from __future__ import annotations

from gateway.media.sdp import SdpError, check_offer
from gateway.sip.message import SipRequest

ALLOW = "INVITE, ACK, CANCEL, BYE, OPTIONS, INFO, UPDATE, PRACK"
SUPPORTED = "100rel, timer"  # the extensions we implement (RFC 3262, RFC 4028): a Require of these is served
SDP_TYPE = "application/sdp"
_EXTENSIONS = frozenset(item.strip() for item in SUPPORTED.split(","))  # a Require of these is served


def allowed_methods(request: SipRequest) -> set[str]:
    """The methods the peer's Allow headers list, upper-cased (RFC 4028 §7.4 refreshes with UPDATE if allowed)."""
    return {item.strip().upper() for line in request.header_lines("Allow") for item in line.split(",")}


def unsupported_extensions(request: SipRequest) -> list[str]:
    """The option tags of the request's Require that we do not implement (§8.2.2.3)."""
    return [tag for line in request.header_lines("Require") for tag in (t.strip() for t in line.split(","))
            if tag and tag.lower() not in _EXTENSIONS]


def contact_value(host: str, port: int, transport: str) -> str:
    """The Contact URI for where we take requests (§8.1.1.8), IPv6 bracketed (RFC 3261 §25.1)."""
    host = f"[{host}]" if ":" in host else host
    suffix = ";transport=tcp" if transport == "tcp" else ""
    return f"<sip:{host}:{port}{suffix}>"


def request_user(invite: SipRequest) -> str:
    """The dialed number: the Request-URI's user part, for sip:, sips: and tel: alike."""
    try:
        return invite.request_user
    except ValueError:  # tel: or another scheme: the part before '@' or ';' is the number
        return invite.uri.partition(":")[2].split("@", 1)[0].split(";", 1)[0]


def sdp_of(request: SipRequest) -> str | None:
    content_type = (request.header("Content-Type") or "").split(";", 1)[0].strip().lower()
    if not request.body or content_type != SDP_TYPE:
        return None
    return request.body.decode("utf-8", "replace")


def offer_refusal(request: SipRequest) -> tuple[int, str] | None:
    """(status, reason) when the request's body is an offer we must refuse, else None."""
    if not request.body:
        return None
    content_type = (request.header("Content-Type") or "").split(";", 1)[0].strip().lower()
    if content_type != SDP_TYPE:
        return 415, f"body type {content_type[:40] or 'missing'!r} is not {SDP_TYPE}"
    try:
        check_offer(request.body.decode("utf-8"))
    except UnicodeDecodeError:
        return 488, "SDP is not valid UTF-8"
    except SdpError as exc:  # the reason goes into a Warning's quoted-string (§20.43)
        return 488, "".join(ch if ch.isprintable() and ch not in '"\\' else "?" for ch in str(exc))
    return None
