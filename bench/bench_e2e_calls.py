"""End-to-end calls as a caller hears them: N concurrent raw-SIP calls into a running `cosyvoice-gateway serve`.

bench_calls.py measures the gateway's sending side (tcpdump on its RTP). This one is an independent caller:
each call has its own SIP socket and RTP socket in this process (plain asyncio UDP, no SIPp), places its INVITE
at ~`--rate` new calls per second, ACKs the 200, answers the gateway's BYE, and times at the receiver:
first packet (INVITE sent -> first RTP packet) and first speech (-> first payload that is not all G.711 zero
codes: an engine whose audio starts quietly shows as a later first speech than first packet), RTP arrival intervals, gaps over
60 ms, 503 answers (with the reason the gateway gave). The gateway is started by the bench itself from a config
(`--config`, or bench_calls' loopback config with `--engine` and `--workers`), with its CPU time read from
/proc for the serve process and its engine workers separately.

    python bench/bench_e2e_calls.py --engine instant --calls 1 50 100
    python bench/bench_e2e_calls.py --engine instant --first-chunk-delay-ms 70 --workers 1 --calls 1 1 1 1 1
    python bench/bench_e2e_calls.py --config gpu.yaml --calls 50 100 200 --rate 10   # a GPU host

Results: bench/results/e2e_calls.json (one row per step).
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
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_calls import cpu_seconds, free_port, gateway_config, metric, wait_http  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
GAP_S = 0.060
_SILENCE = {0: {0xFF, 0x7F}, 8: {0xD5, 0x55}}  # PCMU / PCMA codes of +0 and -0 (G.711 tables)


@dataclass
class Call:
    """One caller: what it heard and when (time.monotonic())."""

    index: int
    status: int = 0
    reason: str = ""
    invite_at: float = 0.0
    first_speech_at: float | None = None
    ended_at: float | None = None
    arrivals: list[float] = field(default_factory=list)


class _Sip(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:
        self.inbox.put_nowait(data)


class _Rtp(asyncio.DatagramProtocol):
    def __init__(self, call: Call) -> None:
        self.call = call

    def datagram_received(self, data: bytes, addr) -> None:
        now = time.monotonic()
        self.call.arrivals.append(now)
        payload_type = data[1] & 0x7F
        silence = _SILENCE.get(payload_type, _SILENCE[0])
        if self.call.first_speech_at is None and any(b not in silence for b in data[12:]):
            self.call.first_speech_at = now


def _headers(message: bytes) -> dict[str, str]:
    lines = message.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    return {line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in lines[1:] if ":" in line}


async def place_call(index: int, sip: tuple[str, int], user: str, timeout_s: float) -> Call:
    loop = asyncio.get_running_loop()
    call = Call(index)
    sip_transport, sip_proto = await loop.create_datagram_endpoint(_Sip, local_addr=("127.0.0.1", 0))
    rtp_transport, _ = await loop.create_datagram_endpoint(lambda: _Rtp(call), local_addr=("127.0.0.1", 0))
    port, rtp_port = sip_transport.get_extra_info("sockname")[1], rtp_transport.get_extra_info("sockname")[1]
    call_id, tag, branch = f"e2e-{index}-{port}@127.0.0.1", f"t{port}", f"z9hG4bK-e2e-{index}-{port}"
    sdp = (f"v=0\r\no=e2e 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=ptime:20\r\n")
    common = (f"From: <sip:e2e@127.0.0.1>;tag={tag}\r\nCall-ID: {call_id}\r\nMax-Forwards: 70\r\n")
    invite = (f"INVITE sip:{user}@{sip[0]}:{sip[1]} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch={branch};rport\r\n"
              f"{common}To: <sip:{user}@{sip[0]}>\r\nCSeq: 1 INVITE\r\nContact: <sip:e2e@127.0.0.1:{port}>\r\n"
              f"Content-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}").encode()
    try:
        call.invite_at = time.monotonic()
        sip_transport.sendto(invite, sip)
        deadline = call.invite_at + timeout_s
        to_header = ""
        while True:  # the final answer to the INVITE
            data = await asyncio.wait_for(sip_proto.inbox.get(), max(deadline - time.monotonic(), 0.01))
            if not data.startswith(b"SIP/2.0 "):
                continue
            code = int(data[8:11])
            if code < 200:
                continue
            call.status, call.reason = code, data.split(b"\r\n", 1)[0][12:].decode(errors="replace")
            to_header = _headers(data).get("to", "")
            ack_branch = branch if code >= 300 else branch + "-ack"  # RFC 3261 §17.1.1.3 / §13.2.2.4
            sip_transport.sendto((f"ACK sip:{user}@{sip[0]}:{sip[1]} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};"
                                  f"branch={ack_branch};rport\r\n{common}To: {to_header}\r\nCSeq: 1 ACK\r\n"
                                  f"Content-Length: 0\r\n\r\n").encode(), sip)
            break
        if call.status != 200:
            return call
        while True:  # the gateway hangs up after its prompt
            data = await asyncio.wait_for(sip_proto.inbox.get(), max(deadline - time.monotonic(), 0.01))
            if data.startswith(b"BYE "):
                call.ended_at = time.monotonic()
                h = _headers(data)
                sip_transport.sendto((f"SIP/2.0 200 OK\r\nVia: {h['via']}\r\nFrom: {h['from']}\r\nTo: {h['to']}\r\n"
                                      f"Call-ID: {h['call-id']}\r\nCSeq: {h['cseq']}\r\nContent-Length: 0\r\n\r\n"
                                      ).encode(), sip)
                return call
    except asyncio.TimeoutError:
        call.reason = call.reason or "timeout"
        return call
    finally:
        sip_transport.close()
        rtp_transport.close()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


async def run_step(calls: int, rate: float, sip: tuple[str, int], gateway_pid: int, timeout_s: float,
                   http_port: int) -> dict:
    workers = _children(gateway_pid)
    underruns0 = await asyncio.to_thread(metric, http_port, "gateway_playout_underruns_total")
    cpu0, wcpu0 = cpu_seconds(gateway_pid), sum(cpu_seconds(p) for p in workers)
    started = time.monotonic()
    tasks = []
    for index in range(calls):  # ~rate new calls per second (a schedule for the caller, not media pacing)
        await asyncio.sleep(max(0.0, started + index / rate - time.monotonic()))
        tasks.append(asyncio.create_task(place_call(index, sip, "bench", timeout_s)))
    results = await asyncio.gather(*tasks)
    wall = time.monotonic() - started
    cpu = cpu_seconds(gateway_pid) - cpu0
    worker_cpu = sum(cpu_seconds(p) for p in workers if Path(f"/proc/{p}").exists()) - wcpu0
    underruns = await asyncio.to_thread(metric, http_port, "gateway_playout_underruns_total") - underruns0
    answered = [c for c in results if c.status == 200]
    first = [1000 * (c.first_speech_at - c.invite_at) for c in answered if c.first_speech_at is not None]
    first_packet = [1000 * (c.arrivals[0] - c.invite_at) for c in answered if c.arrivals]
    intervals = np.concatenate([np.diff(c.arrivals) for c in answered if len(c.arrivals) > 1] or [np.zeros(0)])
    gappy = sum(1 for c in answered if len(c.arrivals) > 1 and np.diff(c.arrivals).max() > GAP_S)
    refusals: dict[str, int] = {}
    for c in results:
        if c.status != 200:
            key = f"{c.status} {c.reason}"
            refusals[key] = refusals.get(key, 0) + 1

    def pct(values, q):
        return round(float(np.percentile(values, q)), 1) if len(values) else None

    return {"calls": calls, "rate_per_s": rate, "answered": len(answered), "refused_503": sum(
        1 for c in results if c.status == 503), "other_outcomes": refusals, "wall_s": round(wall, 2),
            "first_speech_p50_ms": pct(first, 50), "first_speech_p95_ms": pct(first, 95),
            "first_speech_max_ms": pct(first, 100),
            "first_packet_p50_ms": pct(first_packet, 50), "first_packet_p95_ms": pct(first_packet, 95),
            "rtp_interval_p50_ms": pct(1000 * intervals, 50), "rtp_interval_p99_ms": pct(1000 * intervals, 99),
            "rtp_interval_max_ms": pct(1000 * intervals, 100), "calls_with_gap_over_60ms": gappy,
            "underruns": int(underruns),
            "gateway_cpu_s": round(cpu, 2), "gateway_cpu_ms_per_call": round(1000 * cpu / max(len(answered), 1), 1),
            "worker_cpu_s": round(worker_cpu, 2), "engine_workers": len(workers)}


def _wait_serving(serve: subprocess.Popen, http_port: int, timeout_s: float, log_path: Path) -> None:
    """Until /healthz says 200; a serve that exits, or never gets there, fails with its log's tail."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if serve.poll() is not None:
            break
        try:
            wait_http(http_port, timeout=5.0)
            return
        except RuntimeError:
            continue
    tail = "".join(log_path.read_text(errors="replace").splitlines(keepends=True)[-30:])
    raise RuntimeError(f"serve not serving (exit code {serve.poll()}); its log ends:\n{tail}")


def _config_text(args, sip_port: int, http_port: int, prompt_chars: int, max_calls: int) -> str:
    if args.config:
        config = yaml.safe_load(Path(args.config).read_text())
        config.setdefault("sip", {})["listen"] = f"127.0.0.1:{sip_port}"
        config.setdefault("http", {})["listen"] = f"127.0.0.1:{http_port}"
        config["trunks"] = [{"name": "bench", "allow": ["127.0.0.0/8"]}]
    else:
        config = yaml.safe_load(gateway_config(sip_port, http_port, prompt_chars, max_calls, args.engine))
        if args.workers is not None:
            config["engine"]["workers"] = args.workers
        config["engine"].setdefault(args.engine, {})
        if args.engine == "instant":
            config["engine"]["instant"]["realtime"] = True  # a stream lasts as long as its audio, like a model
            config["engine"]["instant"]["first_chunk_delay_ms"] = args.first_chunk_delay_ms  # a model's first chunk
        config["engine"]["worker"] = {"slots": max_calls}
    if args.max_first_audio_ms:
        config["engine"].setdefault("admission", {})["max_first_audio_ms"] = args.max_first_audio_ms
    config.setdefault("routes", []).insert(0, {"match": "bench", "text": ("bench prompt " * 200)[:prompt_chars]})
    config["logging"] = {"level": "warning"}
    return yaml.safe_dump(config, allow_unicode=True)


async def main_async(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        sip_port, http_port = free_port(), free_port(socket.SOCK_STREAM)
        cfg = Path(tmp) / "gateway.yaml"
        max_calls = max(args.calls) + 50
        cfg.write_text(_config_text(args, sip_port, http_port, int(args.prompt_seconds / 0.06), max_calls))
        log_path = args.serve_log or Path(tmp) / "serve.log"
        log = open(log_path, "w")
        serve = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(cfg)], cwd=ROOT,
                                 stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                     p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)})
        try:
            started = time.monotonic()
            await asyncio.to_thread(_wait_serving, serve, http_port, args.start_timeout, log_path)
            print(json.dumps({"serving_after_s": round(time.monotonic() - started, 1)}), flush=True)
            for calls in args.calls:
                row = await run_step(calls, args.rate, ("127.0.0.1", sip_port), serve.pid, args.prompt_seconds * 3 + 30,
                                     http_port)
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            serve.send_signal(signal.SIGTERM)
            try:
                serve.wait(timeout=60)
            except subprocess.TimeoutExpired:
                serve.kill()
    delay = f", first chunk delay {args.first_chunk_delay_ms:g} ms" if args.engine == "instant" and not args.config else ""
    return {"config": args.config or f"bench_calls loopback config, engine {args.engine}, workers {args.workers}{delay}",
            "prompt_seconds": args.prompt_seconds, "machine": f"{os.cpu_count()} cores", "steps": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="end-to-end concurrent calls, measured at the caller")
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 50, 100])
    parser.add_argument("--rate", type=float, default=10.0, help="new calls per second")
    parser.add_argument("--prompt-seconds", type=float, default=6.0)
    parser.add_argument("--engine", default="instant", help="without --config: instant, espeak or cosyvoice2")
    parser.add_argument("--workers", type=int, default=None, help="without --config: engine.workers")
    parser.add_argument("--first-chunk-delay-ms", type=float, default=0.0,
                        help="without --config, engine instant: its first chunk this late (a model's, e.g. 70)")
    parser.add_argument("--config", help="a gateway YAML to serve (its sip/http listen and trunks are replaced)")
    parser.add_argument("--max-first-audio-ms", type=float, default=None, help="engine.admission bound")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    parser.add_argument("--out", type=Path, default=RESULTS / "e2e_calls.json")
    parser.add_argument("--serve-log", type=Path, default=None, help="keep the gateway's log here")
    args = parser.parse_args(argv)
    result = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
