"""`python -m engine_service`: one engine worker process, serving one engine (one GPU, or the CPU) to gateways.

    python -m engine_service --engine espeak --listen 127.0.0.1:0
    python -m engine_service --config /etc/cosyvoice-gateway/gateway.yaml --device cuda:1 \\
        --listen 0.0.0.0:7100 --token-file /etc/cosyvoice-gateway/engine.token

The engine is started (model loaded, warmed up) before the port is opened; then one JSON line goes to stdout,
`{"event": "engine_worker_listening", "url": "ws://HOST:PORT/v1/engine/stream", "pid": ...}`, so a
supervisor that asked for port 0 learns the port. Logs go to stderr. `--supervised` (the gateway's
supervisor): the token is the first line of stdin, and the worker exits when stdin closes, so it never
outlives a gateway that was killed. SIGTERM closes the links (their streams end) and the engine, exit 0.
Beyond loopback the engine link needs a token (`--token-file`): without one the worker refuses to start
(exit 2); on loopback it starts and warns (any local process may drive it).
Exit codes: 0 stopped, 2 bad arguments or engine settings, 1 the engine failed to start or its port is taken.
Settings refused (exit 2) also print `{"event": "engine_worker_refused", "error": ...}` to stdout, so the
supervisor's one-line error says why. The supervisor takes exit 2 as final only before the worker's first ready:
later it cannot be the settings (and other code exits 2 too: Intel MKL's fatal errors do).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

DEFAULT_SLOTS = 64  # engines without a batch size (espeak, instant); the first-audio bound is their real limit


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        name, settings, slots = _engine_choice(args)
    except ValueError as exc:
        return _refused(str(exc))
    from gateway.log import configure_logging

    configure_logging(args.log_level, json=True)
    try:
        return asyncio.run(_serve(args, name, settings, slots))
    except KeyboardInterrupt:
        return 130


def _refused(error: str) -> int:
    """Settings this worker cannot run with: one line for the operator (stderr), one for the supervisor (stdout)."""
    print(f"engine_service: {error}", file=sys.stderr)
    print(json.dumps({"event": "engine_worker_refused", "error": error}), flush=True)
    return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine_service", description="serve one speech engine")
    parser.add_argument("--engine", help="engine name (espeak, instant, cosyvoice2); default: the config's")
    parser.add_argument("--settings", metavar="JSON", help="the engine's settings as a JSON object")
    parser.add_argument("--config", metavar="GATEWAY.yaml", help="take engine name and settings from a gateway config")
    parser.add_argument("--device", help="cosyvoice2: the device to run on (cpu, cuda, cuda:N)")
    parser.add_argument("--slots", type=int, help=f"streams served at once (default: cosyvoice2 max_batch, "
                                                  f"else {DEFAULT_SLOTS})")
    parser.add_argument("--listen", default="127.0.0.1:0", metavar="HOST:PORT", help="default 127.0.0.1:0")
    parser.add_argument("--token-file", metavar="PATH", help="bearer token gateways must send ('-': stdin)")
    parser.add_argument("--tts-api", metavar="JSON", help="serve the speech API with this tts_api block (JSON); "
                        "with --config, the config's tts_api block")
    parser.add_argument("--prepare-texts", metavar="JSON", help="texts to prepare before listening (a JSON list: "
                        "the prompts gateways will ask for); with --config, the config's prompts")
    parser.add_argument("--http-limits", metavar="JSON", help="the port's caps, as engine.worker's keys "
                        "(max_connections, max_connections_per_source, idle_timeout_s, header_timeout_s, "
                        "link_reserve); with --config, the config's engine.worker")
    parser.add_argument("--supervised", action="store_true", help="exit when stdin closes (the supervisor died)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return parser


def _tts_api_choice(args: argparse.Namespace):
    """The speech API's validated settings, or None when it is not to be served. Raises ValueError naming the key."""
    from engine_service.api.settings import TtsApiConfigError, TtsApiSettings

    block = None
    if args.config:
        from gateway.config import load_config

        block = load_config(args.config).tts_api
    if args.tts_api:
        try:
            block = json.loads(args.tts_api)
        except ValueError as exc:
            raise ValueError(f"--tts-api: not JSON ({exc})") from None
    if block is None:
        return None
    try:
        return TtsApiSettings.from_mapping(block)
    except TtsApiConfigError as exc:
        raise ValueError(f"config error: {exc}") from None


def _listener_choice(args: argparse.Namespace):
    """The port's caps as engine.worker's validated section. Raises ValueError naming the key."""
    from gateway.config import load_config
    from gateway.engine_config import EngineWorkerSection

    section = load_config(args.config).engine.worker if args.config else EngineWorkerSection()
    if args.http_limits:
        try:
            section = EngineWorkerSection.model_validate(_json_object_option(args.http_limits, "--http-limits"))
        except Exception as exc:  # noqa: BLE001 - pydantic's error, worded with the key path below
            raise ValueError(f"--http-limits: {_first_problem(exc)}") from None
    return section


def _first_problem(exc: Exception) -> str:
    errors = getattr(exc, "errors", None)
    if not callable(errors):
        return str(exc)
    error = errors()[0]
    message = error["msg"].removeprefix("Value error, ")
    where = ".".join(str(part) for part in error["loc"])
    if not where and message.startswith("@"):  # a cross-field FieldProblem: "@field: message"
        where, _, message = message[1:].partition(": ")
    return f"engine.worker.{where}: {message}"


def _prompt_texts(args: argparse.Namespace) -> list[str]:
    """What to prepare before listening. Raises ValueError naming the option."""
    if args.prepare_texts:
        try:
            texts = json.loads(args.prepare_texts)
        except ValueError as exc:
            raise ValueError(f"--prepare-texts: not JSON ({exc})") from None
        if not isinstance(texts, list) or not all(isinstance(text, str) for text in texts):
            raise ValueError("--prepare-texts: expected a JSON list of strings")
        return texts
    if args.config:
        from gateway.config import load_config

        return list(load_config(args.config).prompt_texts())
    return []


def _engine_choice(args: argparse.Namespace) -> tuple[str, dict[str, Any], int]:
    settings: dict[str, Any] = {}
    name = args.engine
    if args.config:
        from gateway.config import ConfigError, load_config

        try:
            config = load_config(args.config)
        except ConfigError as exc:
            raise ValueError(f"config error: {exc}") from None
        name = name or config.engine.name
        settings = config.engine.settings() if name == config.engine.name else {}
    if args.settings:
        settings = _json_object_option(args.settings, "--settings")
    if not name:
        raise ValueError("--engine or --config is required")
    if args.device:
        if name != "cosyvoice2":
            raise ValueError(f"--device: engine {name} runs on the CPU only")
        settings["device"] = args.device
    slots = args.slots or (int(settings.get("max_batch", 8)) if name == "cosyvoice2" else DEFAULT_SLOTS)
    if slots < 1:
        raise ValueError("--slots: must be at least 1")
    return name, settings, slots


def _json_object_option(value: str, option: str) -> dict[str, Any]:
    try:
        block = json.loads(value)
    except ValueError as exc:
        raise ValueError(f"{option}: not JSON ({exc})") from None
    if not isinstance(block, dict):
        raise ValueError(f"{option}: expected a JSON object")
    return block


def _listen_address(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit():
        raise ValueError(f"--listen: expected HOST:PORT, got {value!r}")
    return host, int(port)


def _loopback(host: str) -> bool:
    """Whether only this host can reach `host` (a wildcard or any other address is reachable from outside)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # another name: it may resolve to anything
        return False


async def _read_token(args: argparse.Namespace) -> str:
    if not args.token_file:
        return ""
    if args.token_file == "-":
        return (await asyncio.to_thread(_stdin_line)).strip()
    with open(args.token_file, encoding="utf-8") as handle:
        return handle.read().strip()


def _stdin_line() -> str:
    """One line from the raw stdin descriptor, byte by byte, so nothing after it is read ahead."""
    line = bytearray()
    while (byte := os.read(0, 1)) and byte != b"\n":
        line += byte
    return line.decode()


async def _serve(args: argparse.Namespace, name: str, settings: dict[str, Any], slots: int) -> int:
    try:
        import structlog
        from aiohttp import web

        from connection_caps.listener import runner_options
        from engine_service.protocol import STREAM_PATH
        from engine_service.server import WORKER, WorkerSettings, make_app, start_listener
        from engine_service.stall_watch import StallWatch
        from engines.base import EngineSettingsError
        from engines.registry import create_engine
    except ImportError as exc:  # a broken install: restarting cannot fix it, so refused (exit 2), in one line
        return _refused(f"this installation lacks what the worker needs ({exc}); install the project with its "
                        "dependencies: pip install -c requirements.lock '.[tts]'")

    log = structlog.get_logger("engine_service")
    try:
        host, port = _listen_address(args.listen)
        token = await _read_token(args)
        if not token and not _loopback(host):
            raise ValueError(f"--listen {args.listen}: beyond loopback the engine link needs a token, or anyone who "
                             "reaches the port can synthesise: start with --token-file PATH (gateways send it as "
                             "engine.remote.token)")
        tts_api = _tts_api_choice(args)
        prompt_texts = _prompt_texts(args)
        listener = _listener_choice(args)
        engine = create_engine(name, settings)
    except (OSError, ValueError, TypeError) as exc:
        return _refused(str(exc))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await engine.start()
        await engine.prepare(prompt_texts)
    except EngineSettingsError as exc:  # a voice the engine lacks, cuda without a GPU: the operator's to fix
        await engine.close()
        return _refused(str(exc))
    except Exception as exc:  # noqa: BLE001 - any start failure: report it in one line and exit 1
        log.error("engine_worker_start_failed", engine=name, error=repr(exc))
        return 1
    limits = listener.http_limits()
    try:
        app = make_app(engine, WorkerSettings(token=token, slots=slots), tts_api)
    except ValueError as exc:  # the tts_api block does not fit this engine (a voice, the slots): exit 2, one line
        await engine.close()
        return _refused(f"config error: {exc}")
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, **runner_options(limits))
    await runner.setup()
    try:
        await start_listener(runner, host, port, limits, listener.link_reserve)
    except OSError as exc:  # a fixed port (--listen, engine.worker.port) another process holds: one line, exit 1
        log.error("engine_worker_listen_failed", listen=args.listen, error=exc.strerror or str(exc))
        await runner.cleanup()
        await engine.close()
        return 1
    bound_host, bound_port = runner.addresses[0][:2]
    shown_host = f"[{bound_host}]" if ":" in bound_host else bound_host
    url = f"ws://{shown_host}:{bound_port}{STREAM_PATH}"
    print(json.dumps({"event": "engine_worker_listening", "url": url, "pid": os.getpid()}), flush=True)
    log.info("engine_worker_listening", engine=name, url=url, slots=slots, token=bool(token),
             speech_api=f"http://{shown_host}:{bound_port}/" if tts_api is not None else None)
    if not token:
        log.warning("engine_worker_link_without_token", url=url,
                    why="any local process can open streams; start with --token-file PATH")
    # The model, engine and prepared prompts live as long as the process: out of the cyclic GC's view, so a full
    # collection while serving walks only what came after (a long walk stops every thread: "worker_stalled").
    gc.collect()
    gc.freeze()
    stalls = StallWatch()
    stalls.start()
    app[WORKER].metrics.watch_stalls(stalls)
    if args.supervised:
        _stop_when_stdin_closes(loop, stop)
    await stop.wait()
    log.info("engine_worker_stopping", engine=name)
    stalls.stop()
    await runner.cleanup()
    await engine.close()
    return 0


def _stop_when_stdin_closes(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """The supervisor holds our stdin open for its whole life: EOF means it is gone (even after kill -9).
    A daemon thread, not the loop's executor: asyncio.run would wait for a read that never returns."""

    def wait_for_eof() -> None:
        while os.read(0, 4096):  # the raw descriptor: a buffered reader's lock would trouble interpreter exit
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait_for_eof, name="supervisor-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
