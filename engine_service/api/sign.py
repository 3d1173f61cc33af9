"""`python -m engine_service.api.sign`: print a signed play URL (signed_url.py) for a key of the worker's config.

    python -m engine_service.api.sign --config gateway.yaml --key ivr --base-url https://tts.example.com \\
        --text "Press one for sales." --voice en --codec pcm16 --rate 8000 --ttl 30d

The key's secret is read from the config's tts_api.api_keys (the YAML read here, not through the gateway's
loader: api/ never imports the gateway) and never printed; exit 2 with one line naming the problem.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

import yaml

from engine_service.api.settings import TtsApiConfigError, TtsApiSettings
from engine_service.api.signed_url import signed_url

_TTL_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


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
    parser.add_argument("--asterisk", action="store_true", help="separate parameters with ';' written '\\;' (for "
                        "Playback() in extensions.conf, which splits at '&' and reads ';' as a comment)")
    args = parser.parse_args(argv)

    try:
        with open(args.config, encoding="utf-8") as file:
            document = yaml.safe_load(file) or {}
        settings = TtsApiSettings.from_mapping(document.get("tts_api") if isinstance(document, dict) else None)
    except (OSError, yaml.YAMLError, TtsApiConfigError) as exc:
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
    url = signed_url(args.base_url, f"/v1/play.{args.file}", params, key.name, key.key, int(time.time()) + args.ttl,
                     separator=";" if args.asterisk else "&")
    print(url.replace(";", "\\;") if args.asterisk else url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
