"""Concurrent-call load test: N calls from SIPp through the gateway with the synthetic instant engine.

For each N it starts the gateway (`cosyvoice-gateway serve`, a separate process so its CPU time is its
own), captures the RTP it sends with tcpdump (kernel timestamps, headers only), drives N concurrent calls
with SIPp (`bench/sipp/uac_listen.xml`: calls stay up until the gateway's BYE after the prompt), and
reports per N: RTP send-interval p50/p99/max across all streams, sequence gaps, playout underruns (from
/metrics), gateway CPU seconds per call-second, first-packet latency p50/p95 (from /metrics histogram
deltas is coarse, so it is taken from the gateway's own log lines `first_speech_packet`).

    python bench/bench_calls.py --calls 100 250 500 --prompt-seconds 8

The largest N with p99 <= 22 ms and zero underruns is printed last and written with everything else to
bench/results/bench_calls.json. Needs: sipp (sip-tester), tcpdump (installed with apt if missing, root).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rtp_pcap import read_rtp_streams, steady_window, summarize  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_config(sip_port: int, http_port: int, prompt_chars: int, max_calls: int, engine: str) -> str:
    text = ("load test prompt " * 40)[:prompt_chars]
    return f"""
sip:
  listen: "127.0.0.1:{sip_port}"
  transports: [udp]
  max_calls: {max_calls}
  flood:
    max_requests_per_s_per_source: 100000  # SIPp places every call from one address, hundreds a second
    max_requests_per_s: 100000
trunks:
  - name: loopback
    allow: ["127.0.0.0/8"]
media:
  rtp_port_range: "30000-40000"
engine:
  name: {engine}
routes:
  - match: "bench"
    text: "{text}"
    voice: en
    after: hangup
http:
  listen: "127.0.0.1:{http_port}"
logging:
  level: info
"""


def scrape(http_port: int) -> str:
    """The gateway's /metrics page."""
    return urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()


def metric_of(body: str, name: str) -> float:
    """A metric's samples of a /metrics page, summed over their labels."""
    total = 0.0
    for line in body.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def metric(http_port: int, name: str) -> float:
    return metric_of(scrape(http_port), name)


def histogram_of(body: str, name: str, labels: str = "") -> dict[float, float]:
    """Cumulative bucket counts of a Prometheus histogram on a /metrics page (of the series whose labels
    include `labels`, e.g. 'generation="2"'): upper bound -> count."""
    buckets = {}
    for line in body.splitlines():
        if line.startswith(name + "_bucket{") and labels in line:
            bound = line.split('le="', 1)[1].split('"', 1)[0]
            buckets[float(bound)] = float(line.rsplit(" ", 1)[1])
    return buckets


def histogram(http_port: int, name: str) -> dict[float, float]:
    return histogram_of(scrape(http_port), name)


def late_share(before: dict[float, float], after: dict[float, float], bound: float) -> float:
    """Share of packet-clock ticks that ran more than `bound` seconds after their deadline."""
    total = after[float("inf")] - before.get(float("inf"), 0.0)
    within = after[bound] - before.get(bound, 0.0)
    return (total - within) / total if total else 0.0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(http_port: int, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
            return
        except OSError:
            time.sleep(0.2)  # start-up wait in a benchmark driver, not media pacing
    raise RuntimeError("gateway did not come up")


def run_level(calls: int, prompt_seconds: float, workdir: Path, engine: str, rate: float | None) -> dict:
    sip_port, http_port, media_port = free_port(), free_port(socket.SOCK_STREAM), free_port()
    cfg = workdir / f"gw_{calls}.yaml"
    cfg.write_text(gateway_config(sip_port, http_port, int(prompt_seconds / 0.06), calls + 50, engine))
    log_path = workdir / f"gw_{calls}.log"
    gw = subprocess.Popen(["cosyvoice-gateway", "serve", "--config", str(cfg)], stderr=log_path.open("w"),
                          stdout=subprocess.DEVNULL)
    pcap = workdir / f"rtp_{calls}.pcap"
    try:
        wait_http(http_port)
        dump = subprocess.Popen(["tcpdump", "-i", "lo", "-s", "64", "-B", "65536", "-w", str(pcap),
                                 "--time-stamp-precision=nano", f"udp and dst port {media_port}"],
                                stderr=subprocess.DEVNULL)
        time.sleep(1.0)  # let tcpdump attach before the first call
        under0, cpu0, t0 = metric(http_port, "gateway_playout_underruns_total"), cpu_seconds(gw.pid), time.monotonic()
        late0 = histogram(http_port, "gateway_packet_clock_lateness_seconds")
        rate = rate or max(10, calls // 2)  # default ramp: all calls placed within ~2 s
        sipp = subprocess.run(
            ["sipp", f"127.0.0.1:{sip_port}", "-sf", str(ROOT / "bench" / "sipp" / "uac_listen.xml"), "-s", "bench",
             "-i", "127.0.0.1", "-p", str(free_port()), "-mi", "127.0.0.1", "-mp", str(media_port),
             "-r", str(rate), "-rp", "1000", "-l", str(calls), "-m", str(calls), "-max_socket", str(calls + 100),
             "-timeout", str(int(prompt_seconds * 3 + 60)), "-nostdin", "-trace_err",
             "-error_file", str(workdir / f"sipp_{calls}.err")],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=prompt_seconds * 4 + 120)
        wall = time.monotonic() - t0
        if sipp.returncode != 0:
            print(f"sipp exit {sipp.returncode}: {sipp.stderr.strip()[-800:]}", flush=True)
        cpu = cpu_seconds(gw.pid) - cpu0
        underruns = metric(http_port, "gateway_playout_underruns_total") - under0
        late1 = histogram(http_port, "gateway_packet_clock_lateness_seconds")
        ticks_late_2ms = late_share(late0, late1, 0.002)
        ticks_late_5ms = late_share(late0, late1, 0.005)
        time.sleep(0.5)
        dump.send_signal(signal.SIGINT)
        dump.wait(timeout=10)
    finally:
        gw.send_signal(signal.SIGTERM)
        try:
            gw.wait(timeout=20)
        except subprocess.TimeoutExpired:
            gw.kill()
    streams = read_rtp_streams(pcap)
    rtp = summarize(streams)
    window = steady_window(streams)
    steady = {f"steady_{k}": v for k, v in summarize(streams, window=window).items()
              if k.startswith("interval") or k == "window_s"} if window else {}
    latencies = [float(m.group(1)) for m in re.finditer(r'"latency_ms": ([0-9.]+)', log_path.read_text())]
    call_seconds = calls * prompt_seconds
    result = {
        "calls": calls, "sipp_rc": sipp.returncode, "wall_s": round(wall, 2), **rtp, **steady,
        "underruns": int(underruns), "cpu_s": round(cpu, 2),
        "ticks_late_over_2ms": round(ticks_late_2ms, 4), "ticks_late_over_5ms": round(ticks_late_5ms, 4),
        "cpu_ms_per_call_second": round(1000 * cpu / call_seconds, 3),
        "cpu_cores_used": round(cpu / wall, 3),
        "first_packet_p50_ms": float(np.percentile(latencies, 50)) if latencies else None,
        "first_packet_p95_ms": float(np.percentile(latencies, 95)) if latencies else None,
    }
    pcap.unlink(missing_ok=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="concurrent-call RTP pacing benchmark")
    parser.add_argument("--calls", type=int, nargs="+", default=[50, 100, 250, 500, 750, 1000])
    parser.add_argument("--prompt-seconds", type=float, default=8.0)
    parser.add_argument("--engine", default="instant", help="instant (load test) or espeak (first-packet latency)")
    parser.add_argument("--rate", type=float, default=None, help="new calls per second (default: calls/2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "bench_calls.json")
    parser.add_argument("--keep", type=Path, default=None, help="keep gateway logs and SIPp errors in this folder")
    args = parser.parse_args(argv)
    if shutil.which("tcpdump") is None:
        subprocess.run(["apt-get", "install", "-y", "-qq", "tcpdump"], check=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.keep or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for n in args.calls:
            print(f"-- {n} concurrent calls ...", flush=True)
            row = run_level(n, args.prompt_seconds, workdir, args.engine, args.rate)
            rows.append(row)
            print(json.dumps(row), flush=True)
    ok = [r["calls"] for r in rows if r.get("steady_interval_p99_ms", 99) <= 22.0 and r["underruns"] == 0
          and r.get("streams") == r["calls"] and r["sipp_rc"] == 0]
    header = f"{'calls':>6} {'streams':>7} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7} {'steady p99':>10} " \
             f"{'steady max':>10} {'gaps':>5} {'underr':>6} {'cpu ms/call-s':>13} {'cores':>5} {'1st p50':>7} {'1st p95':>7}"
    print(header)
    for r in rows:
        print(f"{r['calls']:>6} {r.get('streams', 0):>7} {r.get('interval_p50_ms', float('nan')):>7.2f} "
              f"{r.get('interval_p99_ms', float('nan')):>7.2f} {r.get('interval_max_ms', float('nan')):>7.2f} "
              f"{r.get('steady_interval_p99_ms', float('nan')):>10.2f} {r.get('steady_interval_max_ms', float('nan')):>10.2f} "
              f"{r.get('seq_gaps', -1):>5} {r['underruns']:>6} {r['cpu_ms_per_call_second']:>13.3f} "
              f"{r['cpu_cores_used']:>5.2f} {r['first_packet_p50_ms'] or float('nan'):>7.1f} "
              f"{r['first_packet_p95_ms'] or float('nan'):>7.1f}")
    best = max(ok) if ok else 0
    print(f"largest N with p99 <= 22 ms (while all N calls send) and zero underruns: {best}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"levels": rows, "largest_ok": best, "engine": args.engine,
                                    "prompt_seconds": args.prompt_seconds, "rate": args.rate,
                                    "machine": f"{os.cpu_count()} cores"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
