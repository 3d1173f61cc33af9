"""Soak test: hours of calls in rotation, watching the gateway process for leaks.

Starts `cosyvoice-gateway serve` (instant engine, loopback only) and keeps `--calls` concurrent SIPp calls up
for `--duration-s`: each call hears a `--prompt-s` prompt, gets the gateway's BYE and is replaced at once
(SIPp -l). Every `--sample-s` it samples the serve process's RSS, open file descriptors and threads
(/proc), with active and finished calls from /metrics, prints a progress line and rewrites the JSON.

Verdict "flat": the median of the last `--tail-samples` samples is within tolerance of the median of the
early steady samples (those in the `--warmup-s` .. 2 x `--warmup-s` window): RSS within `--rss-tolerance-mb`
(or `--rss-tolerance-pct` of the early value, whichever is larger); open files and threads within 10 %
+ 8 (they follow the number of calls up at the sampling instant, which jitters with rotation).

    python bench/soak_calls.py                                  # 30 min at 200 calls (the acceptance run)
    python bench/soak_calls.py --duration-s 120 --calls 50      # sanity check

Bounded: SIPp gets a global timeout, the driver stops both processes at `--duration-s` and exits; nothing
leaves 127.0.0.1. Writes bench/results/soak.json (or --out). Needs sipp (sip-tester).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calls import free_port, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def gateway_config(sip_port: int, http_port: int, prompt_s: float, max_calls: int) -> str:
    chars = max(1, int(prompt_s * 1000 / 60))  # the instant engine speaks 60 ms per character
    return f"""
sip: {{listen: "127.0.0.1:{sip_port}", transports: [udp], max_calls: {max_calls}}}
trunks: [{{name: loopback, allow: ["127.0.0.0/8"]}}]
media: {{rtp_port_range: "30000-40000"}}
engine: {{name: instant, instant: {{ms_per_char: 60, max_duration_s: {prompt_s + 5}}}}}
routes: [{{match: soak, text: "{'s' * chars}", after: hangup}}]
http: {{listen: "127.0.0.1:{http_port}"}}
logging: {{level: warning}}
"""


def proc_sample(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mb": round(int(status["VmRSS"].split()[0]) / 1024, 1), "threads": int(status["Threads"]),
            "open_files": len(os.listdir(f"/proc/{pid}/fd"))}


def metrics(http_port: int) -> dict:
    body = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
    out = {"calls_active": 0.0, "calls_ended": 0.0, "calls_completed": 0.0}
    for line in body.splitlines():
        if line.startswith("gateway_calls_active "):
            out["calls_active"] = float(line.split()[-1])
        elif line.startswith("gateway_calls_total{"):
            out["calls_ended"] += float(line.split()[-1])
            if 'outcome="completed"' in line:
                out["calls_completed"] = float(line.split()[-1])
    return {key: int(value) for key, value in out.items()}




def verdict(samples: list[dict], warmup_s: float, tail: int, rss_mb: float, rss_pct: float) -> dict:
    early = [s for s in samples if warmup_s <= s["t_s"] < 2 * warmup_s]
    last = samples[-tail:]
    if not early or len(samples) < tail + len(early):
        return {"flat": None, "reason": "too few samples for a verdict"}
    result: dict = {"early_window_s": [warmup_s, 2 * warmup_s], "tail_samples": len(last)}
    flat = True
    for key in ("rss_mb", "open_files", "threads"):
        start, end = statistics.median(s[key] for s in early), statistics.median(s[key] for s in last)
        allowed = max(rss_mb, start * rss_pct / 100) if key == "rss_mb" else start * 0.10 + 8
        result[key] = {"early": start, "last": end, "growth": round(end - start, 1), "allowed": round(allowed, 1)}
        flat &= end - start <= allowed
    result["flat"] = flat
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=1800)
    parser.add_argument("--calls", type=int, default=200, help="concurrent calls kept up")
    parser.add_argument("--prompt-s", type=float, default=20.0, help="each call's prompt length")
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=None, help="default: 10 %% of the duration, >= 2 prompts")
    parser.add_argument("--tail-samples", type=int, default=5)
    parser.add_argument("--rss-tolerance-mb", type=float, default=16.0)
    parser.add_argument("--rss-tolerance-pct", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args(argv)
    warmup_s = args.warmup_s or max(args.duration_s * 0.1, 2 * args.prompt_s)

    workdir = Path(tempfile.mkdtemp(prefix="soak_"))
    sip_port, http_port, media_port = free_port(), free_port(socket.SOCK_STREAM), free_port()
    config = workdir / "gateway.yaml"
    config.write_text(gateway_config(sip_port, http_port, args.prompt_s, args.calls + 50))
    serve = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)]
    gateway = subprocess.Popen(serve, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(workdir / "gateway.log").open("w"),
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
    sipp = None
    report: dict = {"bench": "soak_calls", "engine": "instant", "calls": args.calls, "prompt_s": args.prompt_s,
                    "duration_s": args.duration_s, "sample_s": args.sample_s, "samples": []}
    try:
        wait_http(http_port)
        rate = max(10, args.calls // 2)  # fill up within ~2 s, then replace each call as it ends
        total = int(args.duration_s / args.prompt_s * args.calls * 2) + args.calls
        sipp = subprocess.Popen(
            ["sipp", f"127.0.0.1:{sip_port}", "-sf", str(ROOT / "bench" / "sipp" / "uac_listen.xml"), "-s", "soak",
             "-i", "127.0.0.1", "-p", str(free_port()), "-mi", "127.0.0.1", "-mp", str(media_port),
             "-r", str(rate), "-rp", "1000", "-l", str(args.calls), "-m", str(total),
             "-max_socket", str(args.calls + 100), "-timeout", f"{int(args.duration_s + 30)}s", "-nostdin",
             "-trace_err", "-error_file", str(workdir / "sipp.err")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0 = time.monotonic()
        next_at = t0
        while (now := time.monotonic()) - t0 < args.duration_s:
            if gateway.poll() is not None or sipp.poll() is not None:
                report["error"] = f"gateway exit {gateway.returncode}, sipp exit {sipp.returncode} before the end"
                break
            sample = {"t_s": round(now - t0, 1), **proc_sample(gateway.pid), **metrics(http_port)}
            report["samples"].append(sample)
            print(f"[{sample['t_s']:7.1f}s] rss {sample['rss_mb']:7.1f} MB  fds {sample['open_files']:5d}  "
                  f"threads {sample['threads']:3d}  active {sample['calls_active']:4d}  "
                  f"ended {sample['calls_ended']:6d}", flush=True)
            next_at += args.sample_s
            time.sleep(max(0.0, next_at - time.monotonic()))  # the sampling period of a driver, not media pacing
        report["verdict"] = verdict(report["samples"], warmup_s, args.tail_samples, args.rss_tolerance_mb,
                                    args.rss_tolerance_pct)
    finally:
        if sipp is not None and sipp.poll() is None:
            sipp.send_signal(signal.SIGUSR1)  # SIPp: stop placing calls and exit
            try:
                sipp.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sipp.kill()
        gateway.send_signal(signal.SIGTERM)
        try:
            report["gateway_exit"] = gateway.wait(timeout=60)
        except subprocess.TimeoutExpired:
            gateway.kill()
            report["gateway_exit"] = "killed"
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report.get("verdict"), indent=1))
    print(f"wrote {args.out}")
    return 0 if report.get("verdict", {}).get("flat") else 1


if __name__ == "__main__":
    sys.exit(main())
