"""Signed play URLs: a PBX that cannot send `Authorization` fetches prompt audio with a signature in the URL.

    /v1/play.wav?text=Hello&voice=en&codec=pcmu&rate=8000&key=ivr&exp=1767225600&sig=<64 hex>

`sig` is HMAC-SHA256, keyed with the named API key's secret, over the canonical form of the URL: its path, "?",
and every query parameter but `sig`, sorted by name and each name and value percent-encoded with nothing left
safe (RFC 3986 unreserved characters stay). The server rebuilds that form from the decoded query it received,
so a URL re-encoded on the way (a PBX writing %20 for +) still verifies, and any changed parameter, path or
expiry does not. `key` names the key (the secret never travels); `exp` is a Unix time after which the URL is
refused. Verification compares in constant time. A URL that is tampered, expired, or names an unknown key gets
403: the signature is the credential, so there is nothing to challenge for (never 401).

Mint one from the worker's config with `python -m engine_service.api.sign` (sign.py).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from urllib.parse import quote

SIGNATURE_PARAMS = ("key", "exp", "sig")


def canonical(path: str, params: Mapping[str, str]) -> str:
    """The signed string: path, '?', the sorted parameters except `sig`, all percent-encoded alike."""
    query = "&".join(f"{quote(name, safe='')}={quote(params[name], safe='')}"
                     for name in sorted(params) if name != "sig")
    return f"{path}?{query}"


def signature(secret: str, path: str, params: Mapping[str, str]) -> str:
    return hmac.new(secret.encode(), canonical(path, params).encode(), hashlib.sha256).hexdigest()


def signature_problem(secret: str, path: str, params: Mapping[str, str], now: float) -> str | None:
    """None if the URL is signed with `secret` and not expired; else what is wrong (for the 403's message)."""
    expiry = params.get("exp", "")
    if not (expiry.isascii() and expiry.isdigit() and len(expiry) <= 12):
        return "exp: missing or not a Unix time"
    good = signature(secret, path, params)
    if not hmac.compare_digest(good.encode(), params.get("sig", "").encode("utf-8", "surrogateescape")):
        return "sig: the signature does not match the URL"
    if int(expiry) < now:
        return f"exp: the URL expired at {expiry}"
    return None


def signed_url(base_url: str, path: str, params: Mapping[str, str], key_name: str, secret: str,
               expires_at: int, separator: str = "&") -> str:
    """A full URL: the parameters (dots encoded too, so a player that finds the file type by the URL's last
    dot, FreeSWITCH's mod_http_cache, still sees '.wav'), the key's name, the expiry and the signature, joined
    by `separator` ('&', or ';' for Asterisk's Playback(), which splits at '&')."""
    signed = {**params, "key": key_name, "exp": str(expires_at)}
    query = separator.join(f"{quote(name, safe='')}={quote(value, safe='').replace('.', '%2E')}"
                           for name, value in sorted(signed.items()))
    return f"{base_url.rstrip('/')}{path}?{query}{separator}sig={signature(secret, path, signed)}"
