"""`cosyvoice-gateway`: the command line. `serve` runs the gateway, `call` is the test phone,
`voice add|list|remove` manage the CosyVoice2 speakers in a model directory, `doctor` checks that this host can
serve a config (gateway/doctor.py), `--version` prints the installed package's version.

Exit codes: 0 success; 1 the action ran and failed (call not answered, voice not registered);
2 the invocation or the configuration is wrong (one line on stderr naming the key or option).
Heavy modules (the gateway, pjsua2, the CosyVoice2 engine) are imported only by the subcommand that
needs them; `voice` reaches tts_core through engines/cosyvoice2/voices.py, never directly.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gateway.config import ConfigError, GatewayConfig, load_config

PROG = "cosyvoice-gateway"
# The engine loads its voices at start; SIGHUP re-reads only the config's `voices` aliases.
VOICE_RESTART = "restart the gateway (systemctl restart cosyvoice-gateway) to use the change"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except ConfigError as exc:
        print(f"{PROG}: config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="SIP gateway that speaks text onto phone calls.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="answer SIP calls and speak")
    serve.add_argument("--config", help="YAML config file (default: built-in loopback config)")
    serve.add_argument("--sip-listen", metavar="HOST:PORT", help="override sip.listen")
    serve.add_argument("--http-listen", metavar="HOST:PORT", help="override http.listen")
    serve.add_argument("--engine", metavar="NAME", help="override engine.name (espeak, instant, cosyvoice2)")
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="override logging.level")
    serve.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                       help="override any config key, VALUE read as YAML (e.g. --set media.inactivity_timeout_s=30 "
                            "--set 'trunks=[{name: lab, allow: [10.0.0.0/8]}]'); repeatable, applied after the file")
    serve.set_defaults(run=_serve)

    call = commands.add_parser("call", help="test phone: call a SIP URI and record what it says")
    call.add_argument("uri", help="e.g. sip:1000@127.0.0.1:5060")
    call.add_argument("--text", help="sent as X-TTS-Text (UTF-8, percent-encoded)")
    call.add_argument("--voice", help="sent as X-TTS-Voice")
    call.add_argument("--record", metavar="OUT.wav", help="record the call (16 kHz mono 16-bit WAV)")
    call.add_argument("--timeout", type=float, default=30.0, metavar="S", help="hang up after S seconds")
    call.add_argument("--codec", default="pcmu,pcma", metavar="LIST",
                      help="codecs to offer, in order: pcmu, pcma, g722 (default pcmu,pcma)")
    call.add_argument("--verbose", action="store_true", help="show PJSIP's log")
    call.set_defaults(run=_call)

    doctor = commands.add_parser("doctor", help="check this host against a config: ports, GPU, model, voices, cache")
    doctor.add_argument("--config", help="YAML config file (default: built-in loopback config)")
    doctor.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="settings",
                        help="override a config key as serve does (repeatable)")
    doctor.add_argument("--cache-dir", type=Path, help="the compiler-cache directory (default: "
                                                       "/var/cache/cosyvoice-gateway, the systemd unit's)")
    doctor.set_defaults(run=_doctor)

    voice = commands.add_parser("voice", help="manage CosyVoice2 voices")
    voice_commands = voice.add_subparsers(dest="voice_command", required=True)
    add = voice_commands.add_parser("add", help="register a speaker from a short prompt recording")
    add.add_argument("name")
    add.add_argument("--wav", required=True, help="1-12 s of the speaker (3-10 s of clean speech works best), "
                                                  "recorded at 16 kHz or more")
    add.add_argument("--text", required=True, help="exactly what is said in the WAV")
    add.add_argument("--model-dir", required=True, help="the CosyVoice2 model directory")
    add.add_argument("--replace", action="store_true", help="overwrite a voice of that name")
    add.set_defaults(run=_voice_add)
    listing = voice_commands.add_parser("list", help="the voices the engine loads: name, prompt length, transcript")
    listing.add_argument("--model-dir", required=True, help="the CosyVoice2 model directory")
    listing.set_defaults(run=_voice_list)
    remove = voice_commands.add_parser("remove", help="delete a voice added with `voice add`")
    remove.add_argument("name")
    remove.add_argument("--model-dir", required=True, help="the CosyVoice2 model directory")
    remove.set_defaults(run=_voice_remove)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cosyvoice-gateway")
    except PackageNotFoundError:  # run from a checkout that was never pip-installed
        return "(not installed: pip install the checkout)"


def _serve(args: argparse.Namespace) -> int:
    overrides = {key: value for key, value in (("sip.listen", args.sip_listen), ("http.listen", args.http_listen),
                                               ("engine.name", args.engine), ("logging.level", args.log_level))
                 if value is not None}
    overrides.update(_settings(args.settings))

    def load() -> GatewayConfig:  # at start, and again on SIGHUP with the same overrides
        return load_config(args.config, overrides)

    config = load()

    from gateway.log import configure_logging

    try:
        configure_logging(config.logging.level, config.logging.json_, config.logging.file)
    except OSError as exc:
        raise ConfigError([f"logging.file: cannot open {config.logging.file} ({exc.strerror})"]) from None
    import gateway.app

    asyncio.run(gateway.app.run(config, load))
    return 0


def _settings(pairs: Sequence[str]) -> dict[str, object]:
    """--set KEY=VALUE pairs as dotted overrides; VALUE is YAML, so 30 is a number and [a, b] a list."""
    import yaml

    settings: dict[str, object] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set {pair}: expected KEY=VALUE (e.g. sip.max_calls=50)"])
        try:
            settings[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError as exc:
            raise ConfigError([f"--set {key.strip()}: VALUE is not valid YAML ({getattr(exc, 'problem', exc)})"]) from None
    return settings


def _call(args: argparse.Namespace) -> int:
    try:
        import pjsua2  # noqa: F401  (checked here for a clear message)
    except ImportError:
        print(f"{PROG}: the test phone needs pjsua2: pip install 'cosyvoice-gateway[phone]'", file=sys.stderr)
        return 2
    from gateway.pjsua_phone import call_in_this_process, describe, parse_codecs

    try:
        codecs = parse_codecs(args.codec)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    result = call_in_this_process(args.uri, args.text, args.record, args.timeout, args.voice, codecs,
                                  verbose=args.verbose)
    print(describe(result))
    return 0 if result.answered else 1


def _doctor(args: argparse.Namespace) -> int:
    from gateway import doctor
    from gateway.log import configure_logging

    configure_logging("warning", json=False)  # the model loaders' info events would break one line per check
    checks = doctor.run(args.config, _settings(args.settings), args.cache_dir)
    for check in checks:
        print(check.line(), flush=True)
    return doctor.exit_code(checks)


def _needs_tts(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The voice commands need the `tts` extra; without it they say so in one line and exit 2."""
    @functools.wraps(run)
    def checked(args: argparse.Namespace) -> int:
        from engines.cosyvoice2.voices import EnrolmentUnavailable

        try:
            return run(args)
        except EnrolmentUnavailable as exc:
            print(f"{PROG}: voice management is not available in this installation ({exc})", file=sys.stderr)
            return 2
    return checked


@_needs_tts
def _voice_add(args: argparse.Namespace) -> int:
    from engines.cosyvoice2.voices import add_voice

    try:
        path = add_voice(args.model_dir, args.name, args.wav, args.text, replace=args.replace)
    except FileExistsError as exc:
        print(f"{PROG}: {exc}; add --replace to overwrite it", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"{PROG}: voice {args.name!r} not added: {exc}", file=sys.stderr)
        return 1
    print(f"voice {args.name!r} {'replaced' if args.replace else 'added'}: {path}; {VOICE_RESTART}")
    return 0


@_needs_tts
def _voice_list(args: argparse.Namespace) -> int:
    from engines.cosyvoice2.voices import list_voices

    try:
        voices = list_voices(args.model_dir)
    except (OSError, ValueError) as exc:
        print(f"{PROG}: cannot list voices: {exc}", file=sys.stderr)
        return 1
    width = max((len(v.name) for v in voices), default=4)
    for v in voices:
        if v.problem:  # the engine would refuse to start with it: say so where the operator looks
            print(f"{v.name:<{width}}  BROKEN  {v.problem}")
        else:
            text = v.transcript if len(v.transcript) <= 50 else v.transcript[:47] + "..."
            print(f"{v.name:<{width}}  {v.prompt_seconds:5.1f} s  {text!r}  ({v.path})")
    return 1 if any(v.problem for v in voices) else 0


@_needs_tts
def _voice_remove(args: argparse.Namespace) -> int:
    from engines.cosyvoice2.voices import remove_voice

    try:
        paths = remove_voice(args.model_dir, args.name)
    except (KeyError, OSError) as exc:
        reason = exc.args[0] if isinstance(exc, KeyError) else exc
        print(f"{PROG}: voice {args.name!r} not removed: {reason}", file=sys.stderr)
        return 1
    print(f"voice {args.name!r} removed from {', '.join(map(str, paths))}; {VOICE_RESTART}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
