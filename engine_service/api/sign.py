"""Signed play URLs: a PBX that cannot send `Authorization` fetches prompt audio with a signature in the URL.

    /v1/play.wav?text=Hello&voice=en&codec=pcmu&rate=8000&key=ivr&exp=1767225600&sig=<64 hex>

`sig` is HMAC-SHA256, keyed with the named API key's secret, over the canonical form of the URL: its path, "?",
and every query parameter but `sig`, sorted by name and each name and value percent-encoded with nothing left
safe (RFC 3986 unreserved characters stay). The server rebuilds that form from the decoded query it received,
so a URL re-encoded on the way (a PBX writing %20 for +) still verifies, and any changed parameter, path or
expiry does not. `key` names the key (the secret never travels); `exp` is a Unix time after which the URL is
refused. Verification compares in constant time. A URL that is tampered, expired, or names an unknown key gets
403: the signature is the credential, so there is nothing to challenge for (never 401).

Mint one from the worker's config:

    python -m engine_service.api.sign --config gateway.yaml --key ivr --base-url https://tts.example.com \\
        --text "Press one for sales." --voice en --codec pcm16 --rate 8000 --ttl 30d
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import sys
import time
from collections.abc import Mapping, Sequence
from urllib.parse import quote

SIGNATURE_PARAMS = ("key", "exp", "sig")
_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


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
    if not expiry.isdigit():
        return "exp: missing or not a Unix time"
    good = signature(secret, path, params)
    if not hmac.compare_digest(good.encode(), params.get("sig", "").encode("utf-8", "surrogateescape")):
        return "sig: the signature does not match the URL"
    if int(expiry) < now:
        return f"exp: the URL expired at {expiry}"
    return None


def signed_url(base_url: str, path: str, params: Mapping[str, str], key_name: str, secret: str,
               expires_at: int) -> str:
    """A full URL: the parameters (dots encoded too, so a player that finds the file type by the URL's last
    dot still sees '.wav'), the key's name, the expiry and the signature."""
    signed = {**params, "key": key_name, "exp": str(expires_at)}
    query = "&".join(f"{quote(name, safe='')}={quote(value, safe='').replace('.', '%2E')}"
                     for name, value in sorted(signed.items()))
    return f"{base_url.rstrip('/')}{path}?{query}&sig={signature(secret, path, signed)}"


def _ttl_seconds(value: str) -> int:
    unit = value[-1:] if value[-1:] in _TTL_UNITS else "s"
    number = value[:-1] if value[-1:] in _TTL_UNITS else value
    if not number.isdigit() or int(number) <= 0:
        raise argparse.ArgumentTypeError(f"{value!r}: a positive number of seconds, or with m, h or d")
    return int(number) * _TTL_UNITS[unit]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine_service.api.sign",
                                     description="print a signed play URL (GET it without any header)")
    parser.add_argument("--config", required=True, metavar="GATEWAY.yaml", help="the config holding tts_api.api_keys")
    parser.add_argument("--key", required=True, help="the API key's name (its secret signs, and stays here)")
    parser.add_argument("--base-url", required=True, help="how the PBX reaches the worker, e.g. https://tts:8001")
    parser.add_argument("--text", required=True)
    parser.add_argument("--voice", help="default: the API's default voice")
    parser.add_argument("--file", default="wav", choices=("wav", "ulaw", "alaw", "sln"),
                        help="the URL's extension: wav, or raw ulaw/alaw (8 kHz)/sln (16-bit)")
    parser.add_argument("--codec", choices=("pcm16", "pcmu", "pcma"), help="inside a wav (default pcm16)")
    parser.add_argument("--rate", type=int, choices=(8000, 16000, 24000), help="sample rate (default 8000)")
    parser.add_argument("--ttl", type=_ttl_seconds, default="30d", help="valid for: 3600, 90m, 12h, 30d (default)")
    args = parser.parse_args(argv)

    from engine_service.api.settings import TtsApiConfigError, TtsApiSettings
    from gateway.config import load_config

    try:
        settings = TtsApiSettings.from_mapping(load_config(args.config).tts_api)
    except (OSError, ValueError, TtsApiConfigError) as exc:
        print(f"{args.config}: {exc}", file=sys.stderr)
        return 2
    key = settings.key_named(args.key)
    if key is None:
        known = ", ".join(k.name for k in settings.api_keys) or "none"
        print(f"--key: no API key named {args.key!r} in tts_api.api_keys (known: {known})", file=sys.stderr)
        return 2
    if args.ttl > settings.play_url.max_signed_ttl_s:
        print(f"--ttl: over tts_api.play_url.max_signed_ttl_s ({settings.play_url.max_signed_ttl_s} s); the "
              "worker would refuse the URL", file=sys.stderr)
        return 2
    params = {"text": args.text}
    params.update({name: str(value) for name, value in
                   (("voice", args.voice), ("codec", args.codec), ("rate", args.rate)) if value is not None})
    print(signed_url(args.base_url, f"/v1/play.{args.file}", params, key.name, key.key,
                     int(time.time()) + args.ttl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
