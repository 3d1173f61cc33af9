"""Time to first audio through the TTS API, beside the engine's own first chunk, at 1/10/50 concurrent clients.

Scenarios (each: N clients start together, repeated to ~--samples samples; time from a client's request to its
first audio byte):
  engine      the engine's first chunk, opened in this process (what the API cannot beat)
  http        POST /v1/tts (pcm_s16le, 8 kHz): first body byte
  openai      POST /v1/audio/speech (pcm, stream_format audio): first body byte
  play_miss   GET /v1/play.wav (8 kHz pcm16) of a text no one asked for yet: first byte, after the whole render
  play_hit    GET /v1/play.wav of a prompt already rendered: first byte, from the worker's memory
  bot_ws      /v1/tts/ws, socket already open: from sending the text + flush to the first binary frame
  jambonz_ws  /v1/jambonz/ws at 10 clients, the same measure with jambonz's messages
  bot_clear   one bot socket: from sending clear to the `cleared` ack, and audio bytes that arrived after it

The API server runs in a child process (this script with --serve), so the clients' CPU time is not the
server's; or pass --url and --key to measure a server that is already running (the engine row is then
measured only if --engine is given explicitly). With --engine-log (the running server's JSON log), each row also
has `engine_in_server_http`/`_ws`: the first chunks the server's engine logged for the row's requests
(tts_job_done / tts_job_cancelled), and `http_added`: each HTTP request's first byte less its own engine first chunk (matched
by X-Request-Id), what HTTP adds.

    python bench/bench_tts_api.py --engine espeak                # local server, writes bench/results/tts_api.json
    python bench/bench_tts_api.py --url http://10.0.0.5:8090 --key ... --clients 1 10 50
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_log import job_events  # noqa: E402
from report_file import RESULTS, write_report  # noqa: E402

SCENARIOS = ("http", "openai", "play", "ws", "clear")
TEXT = "Thank you for calling. Your appointment is confirmed for Tuesday at nine in the morning."
TOKENS = ["Thank", " you", " for", " calling", ".", " Your", " appointment", " is", " confirmed", " for",
          " Tuesday", " at", " nine", " in", " the", " morning", "."]


def summary(samples_s: list[float]) -> dict:
    ms = np.array(samples_s) * 1000.0
    return {"n": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p95_ms": round(float(np.percentile(ms, 95)), 2), "max_ms": round(float(ms.max()), 2)}


# -- the server (child process) -------------------------------------------------------------------------
async def serve(engine_name: str, engine_settings: dict, port: int, key: str) -> None:
    import structlog
    from aiohttp import web

    # stdout carries only the "listening" line, which the parent stops reading; logs on stdout would fill
    # the pipe and block this process's event loop.
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))

    from engine_service.api import TtsApiSettings, add_tts_routes
    from engines.registry import create_engine

    engine = create_engine(engine_name, engine_settings)
    await engine.start()
    app = web.Application()
    add_tts_routes(app, engine, TtsApiSettings.from_mapping(
        {"api_keys": [{"name": "bench", "key": key, "max_streams": 10_000}], "admission_timeout_s": 30}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print(f"listening {runner.addresses[0][1]}", flush=True)
    await asyncio.Event().wait()


def start_server(engine: str, engine_settings: dict, key: str, log_path: Path | None) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen([sys.executable, __file__, "--serve", "--engine", engine,
                              "--engine-settings", json.dumps(engine_settings), "--key", key],
                             stdout=subprocess.PIPE, text=True, env=env,
                             stderr=subprocess.DEVNULL if log_path is None else log_path.open("w"))
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith("listening "):
            return child, f"http://127.0.0.1:{int(line.split()[1])}"
    raise RuntimeError("the API server did not start")


# -- the clients ------------------------------------------------------------------------------------------
async def engine_first_chunk(engine_name: str, engine_settings: dict, clients: int) -> list[float]:
    from engines.base import SynthesisRequest
    from engines.registry import create_engine

    engine = create_engine(engine_name, engine_settings)
    await engine.start()
    try:
        async def one() -> float:
            started = time.monotonic()
            channel = engine.open_stream(SynthesisRequest(text=TEXT, voice=engine.default_voice))
            await channel.admitted()
            first = None
            async for _ in channel:
                first = first or time.monotonic() - started
            return first

        return list(await asyncio.gather(*(one() for _ in range(clients))))
    finally:
        await engine.close()


class EngineLog:
    """A server's JSON log, read from where the last read stopped: call id -> the engine's first chunk (s)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = path.stat().st_size if path.exists() else 0
        self.first_chunks: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        events, self.offset = job_events(self.path, self.offset)
        self.first_chunks.update((event["call_id"], event["first_chunk_s"]) for event in events)
        return self.first_chunks

    async def wait_for(self, ids: list[str], timeout_s: float = 10.0) -> dict[str, float]:
        """The first chunks of `ids`, once all are logged (a cancelled job is logged at the decode loop's next
        iteration), or what is there after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not set(ids) <= self.read().keys() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # polling a file another process writes; not pacing anything
        return self.first_chunks

    def take(self) -> dict[str, float]:
        """Everything read so far, forgotten here."""
        self.read()
        taken, self.first_chunks = self.first_chunks, {}
        return taken


async def http_first_byte(session: aiohttp.ClientSession, url: str) -> tuple[float, str]:
    started = time.monotonic()
    async with session.post(f"{url}/v1/tts", json={"text": TEXT, "format": "pcm_s16le", "sample_rate": 8000}) as r:
        r.raise_for_status()
        await r.content.readany()
        first = time.monotonic() - started
        # Hang up after the first byte: a GPU engine paces later chunks to playback, so reading the whole
        # body would take the audio's length (20 s a request, seen on the H100); the server frees the slot.
        r.close()
    return first, r.headers.get("X-Request-Id", "")


async def openai_first_byte(session: aiohttp.ClientSession, url: str, voice: str) -> tuple[float, str]:
    started = time.monotonic()
    async with session.post(f"{url}/v1/audio/speech",
                            json={"model": "tts-1", "voice": voice, "input": TEXT, "response_format": "pcm"}) as r:
        r.raise_for_status()
        await r.content.readany()
        first = time.monotonic() - started
        r.close()  # as http_first_byte: the first byte is the figure
    return first, r.headers.get("X-Request-Id", "")


async def play_first_byte(session: aiohttp.ClientSession, url: str, text: str) -> float:
    started = time.monotonic()
    async with session.get(f"{url}/v1/play.wav", params={"text": text}) as r:
        r.raise_for_status()
        await r.content.readany()
        return time.monotonic() - started


async def first_byte_scenario(url: str, key: str, clients: int, first_byte) -> list[float]:
    """`first_byte(session, url, n)` for n in range(clients), together."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, connector=connector) as session:
        return list(await asyncio.gather(*(first_byte(session, url, n) for n in range(clients))))


async def ws_first_audio(session: aiohttp.ClientSession, ws_url: str, jambonz: bool,
                         opened: asyncio.Barrier) -> float:
    async with session.ws_connect(ws_url) as ws:
        await ws.receive_json()  # ready / connect
        await opened.wait()  # every client connected: the clock starts for all together
        started = time.monotonic()
        kind = "stream" if jambonz else "text"
        for token in TOKENS:
            await ws.send_json({"type": kind, "text": token})
        await ws.send_json({"type": "flush"})
        while (await ws.receive(timeout=60)).type != aiohttp.WSMsgType.BINARY:
            pass
        return time.monotonic() - started


async def ws_scenario(url: str, key: str, clients: int, jambonz: bool) -> list[float]:
    path = "/v1/jambonz/ws?voice=&language=en-US&sampleRate=8000" if jambonz else "/v1/tts/ws?sample_rate=8000"
    ws_url = url.replace("http", "ws", 1) + path
    opened = asyncio.Barrier(clients)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, connector=connector) as session:
        return list(await asyncio.gather(*(ws_first_audio(session, ws_url, jambonz, opened)
                                           for _ in range(clients))))


async def http_scenario(url: str, key: str, clients: int) -> list[tuple[float, str]]:
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, connector=connector) as session:
        return list(await asyncio.gather(*(http_first_byte(session, url) for _ in range(clients))))


async def clear_scenario(url: str, key: str, rounds: int = 20) -> dict:
    """Barge-in: after the first audio of a long reply, time to `cleared`, audio in flight, and old audio after."""
    ack_s, in_flight, old_after = [], [], 0
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as session:
        async with session.ws_connect(url.replace("http", "ws", 1) + "/v1/tts/ws?sample_rate=8000") as ws:
            await ws.receive_json()
            for _ in range(rounds):
                await ws.send_json({"type": "text", "text": TEXT * 6})
                await ws.send_json({"type": "flush"})
                while (await ws.receive(timeout=60)).type != aiohttp.WSMsgType.BINARY:
                    pass
                started = time.monotonic()
                await ws.send_json({"type": "clear"})
                flight = 0
                while (message := await ws.receive(timeout=60)).type == aiohttp.WSMsgType.BINARY \
                        or message.json()["type"] != "cleared":
                    flight += len(message.data) if message.type == aiohttp.WSMsgType.BINARY else 0
                ack_s.append(time.monotonic() - started)
                in_flight.append(flight)
                await ws.send_json({"type": "text", "text": "Okay."})  # the next reply: nothing old may precede it
                await ws.send_json({"type": "flush"})
                received = 0
                while (message := await ws.receive(timeout=60)).type == aiohttp.WSMsgType.BINARY \
                        or message.json()["type"] != "sentence_end":
                    received += len(message.data) if message.type == aiohttp.WSMsgType.BINARY else 0
                old_after += received - message.json()["audio_bytes"]
    return {"clear_to_cleared": summary(ack_s), "rounds": rounds,
            "audio_bytes_between_clear_and_cleared_max": max(in_flight), "old_audio_bytes_after_cleared": old_after}


async def beside_engine(row: dict, name: str, engine_log: EngineLog | None, samples: list[tuple[float, str]]) -> None:
    """row[name]: the first bytes; with the server's log, `engine_in_server_<name>` (the engine's own first chunk
    of the same requests, matched by X-Request-Id) and `<name>_added` (each request's first byte less its own)."""
    row[name] = summary([first for first, _ in samples])
    if engine_log is None:
        return
    engine = await engine_log.wait_for([request_id for _, request_id in samples])
    matched = [(first, engine[i]) for first, i in samples if i in engine]
    if matched:
        row[f"engine_in_server_{name}"] = summary([e for _, e in matched])
        row[f"{name}_added"] = summary([first - e for first, e in matched])
    engine_log.take()


async def run(args: argparse.Namespace) -> dict:
    engine_settings = json.loads(args.engine_settings)
    # Against --url the server's own engine answers, whatever --engine says (it only names the engine whose
    # first chunk is timed alone here, when given).
    engine_name = args.engine if args.url is None else f"the server at {args.url}"
    report: dict = {"engine": engine_name, "text_chars": len(TEXT), "host": platform.node(),
                    "cpu_count": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M"), "scenarios": {}}
    child = None
    url, key = args.url, args.key
    engine_log = EngineLog(args.engine_log) if args.engine_log else None
    if url is None:
        key = secrets.token_hex(16)
        child, url = start_server(args.engine, engine_settings, key, args.server_log)
    try:
        for clients in args.clients:
            rounds = max(1, args.samples // clients)  # enough rounds for ~`samples` samples per row

            async def pooled_ids(scenario) -> list:
                samples: list = []
                for _ in range(rounds):
                    samples += await scenario()
                return samples

            async def pooled(scenario) -> dict:
                return summary(await pooled_ids(scenario))

            row: dict = {"rounds": rounds}
            if args.url is None or args.engine_given:
                row["engine"] = await pooled(lambda: engine_first_chunk(args.engine, engine_settings, clients))
            if "http" in args.scenarios:
                await beside_engine(row, "http", engine_log, await pooled_ids(lambda: http_scenario(url, key, clients)))
            if "openai" in args.scenarios:
                await beside_engine(row, "openai", engine_log, await pooled_ids(lambda: first_byte_scenario(
                    url, key, clients, lambda session, base, n: openai_first_byte(session, base, args.voice))))
            if "play" in args.scenarios:
                row["play_miss"] = await pooled(lambda: first_byte_scenario(  # a new text per request: every one a miss
                    url, key, clients,
                    lambda session, base, n: play_first_byte(session, base, f"{TEXT} {secrets.token_hex(4)}")))
                if engine_log is not None and (engine := engine_log.take()):  # a miss's render: one engine job each
                    row["engine_in_server_play_miss"] = summary(list(engine.values()))
                await first_byte_scenario(url, key, 1, lambda session, base, n: play_first_byte(session, base, TEXT))
                row["play_hit"] = await pooled(lambda: first_byte_scenario(
                    url, key, clients, lambda session, base, n: play_first_byte(session, base, TEXT)))
                if engine_log is not None:
                    row["engine_jobs_of_play_hits"] = len(engine_log.take())  # the filling request's, no more
            if "ws" in args.scenarios:
                row["bot_ws"] = await pooled(lambda: ws_scenario(url, key, clients, jambonz=False))
                if clients == args.jambonz_clients:
                    row["jambonz_ws"] = await pooled(lambda: ws_scenario(url, key, clients, jambonz=True))
                if engine_log is not None and (engine := engine_log.take()):
                    row["engine_in_server_ws"] = summary(list(engine.values()))
            report["scenarios"][str(clients)] = row
            print(f"{clients:>3} clients: " + ", ".join(f"{name} p50 {s['p50_ms']} ms p95 {s['p95_ms']} ms"
                                                      for name, s in row.items() if isinstance(s, dict)), flush=True)
        if "ws" in args.scenarios and args.jambonz_clients not in args.clients:
            report["scenarios"][f"{args.jambonz_clients}_jambonz"] = {
                "jambonz_ws": summary(await ws_scenario(url, key, args.jambonz_clients, jambonz=True))}
        if "clear" in args.scenarios:
            report["bot_clear"] = await clear_scenario(url, key)
            print(f"clear -> cleared: {report['bot_clear']['clear_to_cleared']}", flush=True)
    finally:
        if child is not None:
            child.terminate()
            child.wait(10)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", default=None, help="espeak (default), instant or cosyvoice2")
    parser.add_argument("--engine-settings", default="{}", help="the engine's settings as JSON")
    parser.add_argument("--url", help="an API server already running (then --key is required)")
    parser.add_argument("--key", help="its API key")
    parser.add_argument("--voice", default="en", help="the OpenAI route's voice (one of the server's)")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--jambonz-clients", type=int, default=10)
    parser.add_argument("--samples", type=int, default=50, help="first-audio samples per row (rounds of N clients)")
    parser.add_argument("--server-log", type=Path, help="where the local server's log goes (default: nowhere)")
    parser.add_argument("--engine-log", type=Path, help="with --url: the running server's JSON log, for the engine's "
                                                         "own first chunk of each request")
    parser.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS,
                        help="which to run (default all): http openai play ws clear")
    parser.add_argument("--out", type=Path, default=RESULTS / "tts_api.json")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.engine_given = args.engine is not None
    args.engine = args.engine or "espeak"
    if args.serve:
        asyncio.run(serve(args.engine, json.loads(args.engine_settings), 0, args.key))
        return
    if args.url is not None and args.key is None:
        parser.error("--url needs --key")
    write_report(asyncio.run(run(args)), args.out, "tts_api")


if __name__ == "__main__":
    main()
