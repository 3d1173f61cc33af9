"""The synthesizer's header fields (RFC 6787 §6.2 generic, §8.4 synthesizer): which we know, which a
SET-PARAMS may set, and whether a value is legal. Pure.

Settable and used: Voice-Name (a voice or alias of the engine), Speech-Language (picks a voice when no
Voice-Name is set), Kill-On-Barge-In, Prosody-Rate (the request option `rate`, a multiplier as in SSML 1.0
prosody, for engines that say `honours_rate`; the others speak at their own pace). Speech-Marker is read-only
(the last marker's timestamp). Other §8.4 fields are known and ignored (a SET-PARAMS naming one answers 201,
§5.4); a name outside the RFC's lists is refused with 403.
"""

from __future__ import annotations

import re

from gateway.mrcp.message import ILLEGAL_HEADER_VALUE, UNSUPPORTED_HEADER, Headers, MessageError

SETTABLE = ("Voice-Name", "Speech-Language", "Prosody-Rate", "Kill-On-Barge-In")
READ_ONLY = ("Speech-Marker",)
GENERIC = frozenset(name.lower() for name in (
    "Channel-Identifier", "Accept", "Active-Request-Id-List", "Proxy-Sync-Id", "Accept-Charset", "Content-Type",
    "Content-ID", "Content-Base", "Content-Encoding", "Content-Location", "Content-Length", "Fetch-Timeout",
    "Cache-Control", "Logging-Tag", "Set-Cookie", "Set-Cookie2", "Vendor-Specific-Parameters"))
IGNORED = frozenset(name.lower() for name in (
    "Jump-Size", "Speaker-Profile", "Completion-Cause", "Completion-Reason", "Voice-Gender", "Voice-Age",
    "Voice-Variant", "Prosody-Pitch", "Prosody-Contour", "Prosody-Range", "Prosody-Duration", "Prosody-Volume",
    "Fetch-Hint", "Audio-Fetch-Hint", "Failed-URI", "Failed-URI-Cause", "Speak-Restart", "Speak-Length",
    "Load-Lexicon", "Lexicon-Search-Order", *READ_ONLY))
_CANONICAL = {name.lower(): name for name in SETTABLE + READ_ONLY}
RATE_WORDS = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.5}
_LANGUAGE = re.compile(r"[A-Za-z]{1,8}(-[A-Za-z0-9]{1,8})*")


def canonical(name: str) -> str | None:
    """The settable or read-only field `name` names, spelled as the RFC does, or None."""
    return _CANONICAL.get(name.lower())


def check_names(request_id: int, headers: Headers) -> None:
    """403 for a header field no MRCPv2 synthesizer knows (§5.4), naming it."""
    for name in headers.names():
        lowered = name.lower()
        if lowered not in GENERIC and lowered not in IGNORED and lowered not in _CANONICAL:
            raise MessageError(UNSUPPORTED_HEADER, f"header {name[:40]!r} is not an MRCPv2 synthesizer header",
                               request_id, 0)


def settable_values(request_id: int, headers: Headers) -> dict[str, str]:
    """The settable fields among `headers`, values checked (404 naming the field when one is illegal)."""
    values: dict[str, str] = {}
    for name, value in headers.items:
        field = canonical(name)
        if field is None or field in READ_ONLY:
            continue
        problem = _value_problem(field, value)
        if problem is not None:
            raise MessageError(ILLEGAL_HEADER_VALUE, f"{field}: {problem}", request_id, 0)
        values[field] = value.lower() if field == "Kill-On-Barge-In" else value
    return values


def ignored_names(headers: Headers) -> list[str]:
    """Fields we accept but do not act on (a SET-PARAMS with any of them is answered 201)."""
    return [name for name in headers.names() if name.lower() in IGNORED]


def _value_problem(field: str, value: str) -> str | None:
    if field == "Voice-Name":
        if not value or len(value) > 64 or not value.isprintable():
            return "expected a voice name of 1-64 printable characters"
    elif field == "Speech-Language":
        if not _LANGUAGE.fullmatch(value):
            return f"{value[:40]!r} is not a language tag (RFC 5646, e.g. en-US)"
    elif field == "Prosody-Rate":
        if value.lower() not in RATE_WORDS and not _positive_number(value):
            return f"{value[:20]!r}: expected {', '.join(RATE_WORDS)} or a number from 0.25 to 4 (§8.4.8)"
    elif field == "Kill-On-Barge-In":
        if value.lower() not in ("true", "false"):
            return f"{value[:20]!r}: expected true or false"
    return None


def _positive_number(value: str) -> bool:
    try:
        number = float(value)
    except ValueError:
        return False
    return 0.25 <= number <= 4 and value.replace(".", "", 1).isdigit()


def rate_multiplier(value: str) -> float:
    """A checked Prosody-Rate as a multiplier of the voice's pace (1.0: unchanged)."""
    return RATE_WORDS.get(value.lower()) or float(value)
