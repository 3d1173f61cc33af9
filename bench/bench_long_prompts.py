"""Does a long prompt delay everyone? Five callers ask for 2,000-character prompts at once, then one caller asks
for a short one; the short call's first speech is timed at the caller (issue: 698 ms behind five such prompts
with one espeak thread). Runs `serve` (espeak) in the arrangement asked for and prints one JSON row each:

    python bench/bench_long_prompts.py --workers 0 2 --max-first-audio-ms 0 400

`--workers 0`: espeak inside the gateway, one speech thread. `--workers N`: N worker processes.
`--max-first-audio-ms B`: admission refuses (503) a call whose expected first audio is over B (0: no bound).
Results: bench/results/long_prompts.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calls import free_port, wait_http  # noqa: E402
from e2e_caller import place_call  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LONG = ("This is a long announcement that goes on and on about opening hours and options. " * 30)[:2000]
SHORT = "Hello, your call is important to us."


def _config(sip_port: int, http_port: int, workers: int, bound_ms: float) -> str:
    engine: dict = {"name": "espeak", "workers": workers}
    if bound_ms:
        engine["admission"] = {"max_first_audio_ms": bound_ms}
    return yaml.safe_dump({
        "sip": {"listen": f"127.0.0.1:{sip_port}", "transports": ["udp"]},
        "http": {"listen": f"127.0.0.1:{http_port}"},
        "trunks": [{"name": "bench", "allow": ["127.0.0.0/8"]}],
        "media": {"rtp_port_range": "30000-40000"},
        "engine": engine,
        # cache: false: each call is engine work (route texts are kept by the prompt cache unless they say not)
        "routes": [{"match": "long", "text": LONG, "cache": False}, {"match": "short", "text": SHORT, "cache": False}],
        "shutdown": {"drain_timeout_s": 1},  # the long calls are not waited for at the end
        "logging": {"level": "warning"}})


async def one_arrangement(workers: int, bound_ms: float, long_calls: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sip_port, http_port = free_port(), free_port(socket.SOCK_STREAM)
        config = Path(tmp) / "gateway.yaml"
        config.write_text(_config(sip_port, http_port, workers, bound_ms))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
        serve = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            await asyncio.to_thread(wait_http, http_port, 60.0)
            sip = ("127.0.0.1", sip_port)
            await place_call(0, sip, "short", 30.0)  # warm-up: every worker has spoken once
            longs = [asyncio.create_task(place_call(1 + i, sip, "long", 300.0)) for i in range(long_calls)]
            await asyncio.sleep(0.05)  # the long prompts are queued first (a schedule, not media pacing)
            short = await place_call(99, sip, "short", 60.0)
            for task in longs:
                task.cancel()
            await asyncio.gather(*longs, return_exceptions=True)
        finally:
            serve.send_signal(signal.SIGTERM)
            serve.wait(30)
    first = None if short.first_speech_at is None else round(1000 * (short.first_speech_at - short.invite_at), 1)
    return {"workers": workers, "max_first_audio_ms": bound_ms or None, "long_calls": long_calls,
            "short_call_status": short.status, "short_call_reason": short.reason, "short_first_speech_ms": first}


async def main_async(args) -> list[dict]:
    rows = []
    for workers in args.workers:
        for bound in args.max_first_audio_ms:
            row = await one_arrangement(workers, bound, args.long_calls)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--max-first-audio-ms", type=float, nargs="+", default=[0, 400])
    parser.add_argument("--long-calls", type=int, default=5)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "long_prompts.json")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    args.out.write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
