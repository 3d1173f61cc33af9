"""First RTP packet after the 200 OK: prompt cache hits against misses, through a real gateway process.

The gateway (`python -m gateway.cli serve`, espeak, then the instant engine with a 150 ms first chunk; memory cache) takes sequential calls from a raw-SIP
caller: `--calls` misses (each a text never asked before, `X-TTS-Cache: yes`), then as many hits (one text the
gateway has cached). Both the 200 OK and the first RTP packet are stamped by the kernel as they arrive
(SO_TIMESTAMPNS on both sockets), so the figure is the gateway's, not this process's event loop's. A hit has its
whole prompt before the 200 is sent: its first packet should follow the 200 at once. A miss waits for the
engine's first chunk and the playout pre-roll.

    python bench/bench_prompt_cache.py --calls 20

Writes bench/results/prompt_cache.json (p50/p95/max per kind, in ms, and the INVITE-to-200 time).
"""

from __future__ import annotations

import argparse
import json
import select
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)
_TIMESPEC = struct.Struct("@ll")
_ANCBUF = socket.CMSG_SPACE(_TIMESPEC.size)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stamped_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


def _receive(sock: socket.socket) -> tuple[bytes, int]:
    data, ancillary, _, _ = sock.recvmsg(65535, _ANCBUF)
    seconds, nanoseconds = _TIMESPEC.unpack(ancillary[0][2])
    return data, seconds * 1_000_000_000 + nanoseconds


def _headers(message: bytes) -> dict[str, str]:
    lines = message.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    return {line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in lines[1:] if ":" in line}


def call(sip: tuple[str, int], index: int, text: str, timeout_s: float = 20.0) -> dict:
    """One call: INVITE (X-TTS-Cache: yes), ACK, hear until the gateway's BYE. Kernel times in ns."""
    sig, rtp = _stamped_socket(), _stamped_socket()
    port, rtp_port = sig.getsockname()[1], rtp.getsockname()[1]
    sdp = (f"v=0\r\no=b 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n")
    common = f"From: <sip:b@127.0.0.1>;tag=t{port}\r\nCall-ID: pc-{index}-{port}@127.0.0.1\r\nMax-Forwards: 70\r\n"
    branch = f"z9hG4bK-pc-{index}-{port}"
    invite = (f"INVITE sip:bench@{sip[0]}:{sip[1]} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch={branch};rport\r\n"
              f"{common}To: <sip:bench@{sip[0]}>\r\nCSeq: 1 INVITE\r\nContact: <sip:b@127.0.0.1:{port}>\r\n"
              f"X-TTS-Text: {text}\r\nX-TTS-Cache: yes\r\n"
              f"Content-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}").encode()
    result: dict = {"invite_ns": time.time_ns(), "ok_ns": None, "first_rtp_ns": None}
    sig.sendto(invite, sip)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([sig, rtp], [], [], 0.5)
            if rtp in ready:
                _, at = _receive(rtp)
                result["first_rtp_ns"] = result["first_rtp_ns"] or at
            if sig not in ready:
                continue
            data, at = _receive(sig)
            if data.startswith(b"SIP/2.0 200") and result["ok_ns"] is None:
                result["ok_ns"] = at
                to = _headers(data)["to"]
                sig.sendto((f"ACK sip:bench@{sip[0]}:{sip[1]} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};"
                            f"branch={branch}-ack;rport\r\n{common}To: {to}\r\nCSeq: 1 ACK\r\nContent-Length: 0\r\n\r\n"
                            ).encode(), sip)
            elif data.startswith(b"SIP/2.0 ") and int(data[8:11]) >= 300:
                status = data.split(b"\r\n", 1)[0].decode()
                raise RuntimeError(f"call {index}: {status}")
            elif data.startswith(b"BYE "):
                h = _headers(data)
                sig.sendto((f"SIP/2.0 200 OK\r\nVia: {h['via']}\r\nFrom: {h['from']}\r\nTo: {h['to']}\r\n"
                            f"Call-ID: {h['call-id']}\r\nCSeq: {h['cseq']}\r\nContent-Length: 0\r\n\r\n").encode(), sip)
                return result
        raise RuntimeError(f"call {index}: no BYE within {timeout_s} s")
    finally:
        sig.close()
        rtp.close()


def _summary(results: list[dict]) -> dict:
    after_ok = np.array([(r["first_rtp_ns"] - r["ok_ns"]) / 1e6 for r in results])
    to_ok = np.array([(r["ok_ns"] - r["invite_ns"]) / 1e6 for r in results])
    return {"calls": len(results),
            "first_packet_after_200_ms": {"p50": round(float(np.percentile(after_ok, 50)), 2),
                                          "p95": round(float(np.percentile(after_ok, 95)), 2),
                                          "max": round(float(after_ok.max()), 2)},
            "invite_to_200_ms": {"p50": round(float(np.percentile(to_ok, 50)), 2),
                                 "p95": round(float(np.percentile(to_ok, 95)), 2)}}


def run(calls: int, engine: str) -> dict:
    """Start a gateway with `engine` (a YAML flow mapping), place the calls, return the summaries."""
    sip_port, http_port = free_port(), free_port()
    with tempfile.TemporaryDirectory() as workdir:
        config = Path(workdir) / "gateway.yaml"
        config.write_text(f"""
sip: {{listen: "127.0.0.1:{sip_port}", transports: [udp], t1_ms: 500}}
media: {{rtp_port_range: "36000-36999"}}
engine: {engine}
http: {{listen: "127.0.0.1:{http_port}"}}
routes: [{{match: "1", text: "unused"}}]
logging: {{level: warning}}
""")
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)],
                                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=(Path(workdir) / "log").open("w"))
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{http_port}/healthz", timeout=1)
                    break
                except OSError:
                    time.sleep(0.1)  # waiting for the process to listen, not pacing media
            sip = ("127.0.0.1", sip_port)
            misses = [call(sip, i, f"Your ticket number is {1000 + i}, thank you.") for i in range(calls)]
            hit_text = "Thank you for calling, please hold the line."
            call(sip, -1, hit_text)  # fills the cache
            hits = [call(sip, calls + i, hit_text) for i in range(calls)]
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=5).read().decode()
        finally:
            gateway.terminate()
            gateway.wait(30)
    counted = {line.split(" ")[0]: float(line.split(" ")[1]) for line in metrics.splitlines()
               if line.startswith("gateway_prompt_cache_hits_total") or line.startswith("gateway_prompt_cache_misses")}
    return {"engine": engine, "miss": _summary(misses), "hit": _summary(hits), "gateway_counts": counted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="misses, then as many hits, per engine")
    parser.add_argument("--out", type=Path, default=RESULTS / "prompt_cache.json")
    args = parser.parse_args(argv)
    report = {"what": "first RTP packet after the 200 OK (kernel timestamps), sequential calls; the instant "
                      "engine with a 150 ms first chunk stands in for a GPU model's time to first audio",
              "command": f"python bench/bench_prompt_cache.py --calls {args.calls}",
              "host": "2-core shared CI box (timings noisy)", "date": time.strftime("%Y-%m-%d"),
              "runs": [run(args.calls, engine) for engine in
                       ("{name: espeak}", "{name: instant, instant: {first_chunk_delay_ms: 150}}")]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
