"""How fast a supervised engine worker is ready: at first start, and again after `kill -9`.

Starts `cosyvoice-gateway serve` from a config (`--config`; a cosyvoice2 worker on a GPU host, or
the instant engine for a CPU check), times from the start until /healthz answers 200 (ready: the
worker captured, warmed up with one real synthesis and connected), then `--restarts` times kills the
worker with SIGKILL and times until /healthz is 200 again. Each start's stages come from the
worker's `cosyvoice2_engine_started` log event (`stages`: weights, per captured part its compile /
warm-up runs / recording split, warm-up synthesis, total, whether the compiler cache was warm) and
`compiled_graphs_complete`: the worker is ready on graphs of the eager modules and swaps the
compiled ones in while it serves. `--wait-compiled S` places a call every `--call-every-s` while
that runs (first speech during the background compile) and calls again once it is done.

    python bench/bench_worker_start.py --config gpu.yaml --restarts 2
    python bench/bench_worker_start.py --engine instant --restarts 1        # CPU: the bench itself

Results: bench/results/worker_start.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import asyncio

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calls import free_port, gateway_config  # noqa: E402
from e2e_caller import place_call  # noqa: E402
from engine_log import job_events, serve_events  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
STAGE_EVENTS = ("cosyvoice2_engine_started", "compiled_graphs_complete", "compiled_graphs_failed",
                "engine_worker_started", "engine_worker_exited")


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_ready(url: str, serve: subprocess.Popen, limit_s: float) -> float | None:
    """Seconds until `url` answers 200 (polled every 0.1 s); None past `limit_s` or if serve exits."""
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if healthy(url):
            return round(time.monotonic() - started, 2)
        if serve.poll() is not None:
            return None
        time.sleep(0.1)
    return None


def worker_pids(events: list[dict]) -> list[int]:
    return [e["pid"] for e in events if e["event"] == "engine_worker_started" and "pid" in e]


def start_record(events: list[dict], ready_s: float | None) -> dict:
    started = [e for e in events if e["event"] == "cosyvoice2_engine_started"]
    compiled = [e for e in events if e["event"] in ("compiled_graphs_complete", "compiled_graphs_failed")]
    record: dict = {"ready_s": ready_s}
    if started:
        record["stages"] = started[-1].get("stages")
        record["load_s"] = started[-1].get("load_s")
    if compiled:  # the compiled graphs, captured while serving: how long, from about the ready
        record["compiled_graphs"] = {"event": compiled[-1]["event"], "seconds": compiled[-1].get("seconds"),
                                     "parts": compiled[-1].get("parts")}
    return record


def one_call(index: int, sip: tuple[str, int], log_path: Path, timeout_s: float) -> dict:
    """A call: its first speech at the caller (kernel timestamps) and the engine's first chunk (its
    tts_job_done or tts_job_cancelled), in ms."""
    offset = log_path.stat().st_size
    call = asyncio.run(place_call(index, sip, "bench", timeout_s, hang_up_after_s=1.0))
    jobs: list[dict] = []
    waited = time.monotonic()
    # The worker logs the job (cancelled by the hang-up, first chunk included) at its next chunk.
    while not jobs and time.monotonic() - waited < 5.0:
        time.sleep(0.2)
        jobs = [e for e in job_events(log_path, offset)[0]
                if e["event"] in ("tts_job_done", "tts_job_cancelled") and e.get("call_id") == call.call_id
                and e.get("first_chunk_s") is not None]
    return {"status": call.status,
            "first_speech_ms": None if call.first_speech_ns is None
            else round((call.first_speech_ns - call.invite_ns) / 1e6, 1),
            "engine_first_chunk_ms": round(1000 * jobs[0]["first_chunk_s"], 1) if jobs else None}


def calls_after_ready(count: int, sip: tuple[str, int], log_path: Path, timeout_s: float) -> list[dict]:
    """`count` calls one after another."""
    return [one_call(index, sip, log_path, timeout_s) for index in range(count)]


def calls_while_compiling(ready_at: float, offset: int, every_s: float, limit_s: float, sip: tuple[str, int],
                          log_path: Path) -> tuple[list[dict], bool]:
    """A call every `every_s` until the worker logs compiled_graphs_complete (or failed) after
    `offset`, at most `limit_s`: each call's record with its start in seconds after the ready.
    Returns the calls and whether the compiled graphs came in."""
    calls = []
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if serve_events(log_path, ("compiled_graphs_complete", "compiled_graphs_failed"), offset):
            return calls, True
        at = time.monotonic()
        calls.append({"after_ready_s": round(at - ready_at, 1), **one_call(len(calls), sip, log_path, 30)})
        time.sleep(max(0.0, at + every_s - time.monotonic()))
    return calls, False


def wait_for(predicate, limit_s: float) -> bool:
    started = time.monotonic()
    while time.monotonic() - started < limit_s:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def run(config_path: Path, http_url: str, restarts: int, limit_s: float, log_path: Path,
        settle_s: float, repo: Path, calls: int, sip: tuple[str, int], save, wait_compiled_s: float = 0.0,
        call_every_s: float = 5.0, wait_compiled_starts: int = 1_000) -> dict:
    """The starts' records; `save(result)` after each, so a run cut short keeps what it measured.
    `wait_compiled_s`: after each start's calls, call every `call_every_s` until the compiled graphs
    are in (at most that long), then `calls` calls again."""

    def follow(record: dict, ready_at: float, offset: int) -> None:
        if wait_compiled_s <= 0 or len(starts) > wait_compiled_starts:
            return
        during, complete = calls_while_compiling(ready_at, offset, call_every_s, wait_compiled_s, sip, log_path)
        record["calls_while_compiling"] = during
        time.sleep(settle_s)
        record.update({k: v for k, v in start_record(serve_events(log_path, STAGE_EVENTS, offset), None).items()
                       if k == "compiled_graphs"})
        if complete:
            record["calls_after_compiled"] = calls_after_ready(calls, sip, log_path, 60)

    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH")) if p))
    with open(log_path, "wb") as log:
        serve = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config_path)],
                                 stdout=log, stderr=subprocess.STDOUT, cwd=repo, env=env)
    health = f"{http_url}/healthz"
    starts: list[dict] = []
    try:
        ready = wait_ready(health, serve, limit_s)
        # The stage events are logged just before ready; background graphs may follow.
        ready_at = time.monotonic()
        time.sleep(settle_s)
        events = serve_events(log_path, STAGE_EVENTS)
        starts.append({"kind": "first", **start_record(events, ready)})
        if ready is None:
            return {"starts": starts, "error": "not ready"}
        starts[-1]["calls_after_ready"] = calls_after_ready(calls, sip, log_path, 60)
        follow(starts[-1], ready_at, 0)
        save({"starts": starts})
        for round_ in range(restarts):
            offset = log_path.stat().st_size
            pids = worker_pids(events)
            if not pids:
                return {"starts": starts, "error": "no engine_worker_started pid in the log"}
            os.kill(pids[-1], signal.SIGKILL)
            killed = time.monotonic()
            # Not ready any more (the gateway noticed), then ready again.
            wait_for(lambda: not healthy(health), 10)
            ready = wait_ready(health, serve, limit_s)
            ready_at = time.monotonic()
            ready = None if ready is None else round(ready_at - killed, 2)
            time.sleep(settle_s)
            events = serve_events(log_path, STAGE_EVENTS, offset)
            starts.append({"kind": f"restart {round_ + 1} after kill -9", **start_record(events, ready)})
            if ready is None:
                return {"starts": starts, "error": "not ready after a restart"}
            starts[-1]["calls_after_ready"] = calls_after_ready(calls, sip, log_path, 60)
            follow(starts[-1], ready_at, offset)
            save({"starts": starts})
            events = serve_events(log_path, STAGE_EVENTS)
        return {"starts": starts}
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.wait(30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, help="serve config (engine.worker supervised); default: a loopback "
                                               "config for --engine")
    p.add_argument("--engine", default="instant", help="without --config: the engine of the loopback config")
    p.add_argument("--restarts", type=int, default=1, help="kill -9 rounds after the first start")
    p.add_argument("--limit-s", type=float, default=400.0, help="give up on a start after this long")
    p.add_argument("--settle-s", type=float, default=1.0, help="wait after each ready before reading the log")
    p.add_argument("--calls-after-ready", type=int, default=0,
                   help="calls placed one after another after each ready (first speech, engine first chunk)")
    p.add_argument("--wait-compiled", type=float, default=0.0, metavar="S",
                   help="after each start: call every --call-every-s until compiled_graphs_complete (at most S), "
                        "then --calls-after-ready calls again")
    p.add_argument("--call-every-s", type=float, default=5.0)
    p.add_argument("--wait-compiled-starts", type=int, default=1_000, help="--wait-compiled for the first N starts only")
    p.add_argument("--repo", type=Path, default=ROOT, help="the checkout whose gateway runs (default this one)")
    p.add_argument("--label", default="", help="a note stored with the results")
    p.add_argument("--log", type=Path, help="keep serve's log here")
    p.add_argument("--out", type=Path, default=RESULTS / "worker_start.json")
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="worker-start-"))
    if args.config is not None:
        config = yaml.safe_load(args.config.read_text())
        http_port = int(str(config["http"]["listen"]).rsplit(":", 1)[1])
    else:
        http_port = free_port()
        config = yaml.safe_load(gateway_config(free_port(), http_port, 40, 10, args.engine))
        config["engine"]["workers"] = 1  # supervised: the worker is what gets killed
    config_path = tmp / "serve.yaml"
    config_path.write_text(yaml.safe_dump(config))
    log_path = args.log or tmp / "serve.log"
    host, port = str(config["sip"]["listen"]).rsplit(":", 1)
    about = {"label": args.label, "engine": config["engine"]["name"],
             "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
             "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        args.out.write_text(json.dumps({**result, **about}, indent=1) + "\n")

    # A `timeout` around this bench sends SIGTERM: leave through `run`'s finally, which stops serve.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("bench_worker_start: terminated"))
    result = run(config_path, f"http://127.0.0.1:{http_port}", args.restarts, args.limit_s, log_path, args.settle_s,
                 args.repo.resolve(), args.calls_after_ready, (host, int(port)), save, args.wait_compiled,
                 args.call_every_s, args.wait_compiled_starts)
    save(result)
    result.update(about)
    for start in result["starts"]:
        print(f"{start['kind']:>26}: ready {start['ready_s']} s  stages {json.dumps(start.get('stages'))}")
    if "error" in result:
        sys.exit(f"bench_worker_start: {result['error']} (log: {log_path})")


if __name__ == "__main__":
    main()
