"""MRCPv2 benchmark: a SPEAK's first RTP packet, and how soon STOP silences the channel.

Starts `python -m gateway.cli serve` with MRCP on (espeak by default; `--config` for a GPU config, whose
`mrcp:` block must be enabled), opens one session per round from a raw client (SIP INVITE over UDP, the
control connection over TCP, an RTP socket), and per round:

- `speak_to_first_rtp_ms`: from writing SPEAK to the first RTP packet's arrival (the engine's first chunk,
  the playout start threshold and the packet clock, as a caller hears it);
- `stop_to_response_ms` and `stop_to_last_rtp_ms`: from writing STOP, half a second into the speech, to its
  `200 COMPLETE` and to the last RTP packet that arrives (the goal: under 40 ms, issue #34).

    python bench/bench_mrcp.py --rounds 20
    python bench/bench_mrcp.py --config sip_config/gateway-cosyvoice2.yaml --set mrcp.enabled=true --rounds 20
    python bench/bench_mrcp.py --sip-port 5060 --engine-log serve.log --out mrcp.json   # a serve already running

With --engine-log, the report has the engine's own first chunk of the same SPEAKs (its tts_job_done lines, by
the session's Call-ID) and the SPEAK-to-first-RTP time less it.

Writes bench/results/mrcp.json (one file: the current result, with the command and host load).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from engine_log import job_events  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "mrcp.json"
TEXT = ("This sentence is long on purpose, so that there is speech to stop half a second into it, "
        "and then some more of it that nobody hears.")


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Rtp(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.arrivals: list[float] = []
        self.first = asyncio.Event()

    def datagram_received(self, data: bytes, addr) -> None:
        self.arrivals.append(time.monotonic())
        self.first.set()


def mrcp_request(method: str, request_id: int, channel: str, body: bytes = b"") -> bytes:
    head = f"Channel-Identifier: {channel}\r\n"
    if body:
        head += f"Content-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
    rest = head.encode() + b"\r\n" + body
    length = len(rest)
    while len(f"MRCP/2.0 {length} {method} {request_id}\r\n") + len(rest) != length:
        length = len(f"MRCP/2.0 {length} {method} {request_id}\r\n") + len(rest)
    return f"MRCP/2.0 {length} {method} {request_id}\r\n".encode() + rest


async def read_message(reader: asyncio.StreamReader) -> str:
    line = await reader.readuntil(b"\r\n")
    rest = await reader.readexactly(int(line.split()[1]) - len(line))
    return (line + rest).decode(errors="replace")


async def one_round(sip_port: int, index: int) -> dict:
    loop = asyncio.get_running_loop()
    transport, rtp = await loop.create_datagram_endpoint(Rtp, local_addr=("127.0.0.1", 0))
    rtp_port = transport.get_extra_info("sockname")[1]
    sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sip.bind(("127.0.0.1", 0))
    sip.setblocking(False)
    port = sip.getsockname()[1]
    sdp = ("v=0\r\no=b 0 0 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           "m=application 9 TCP/MRCPv2 1\r\na=setup:active\r\na=connection:new\r\na=resource:speechsynth\r\n"
           f"a=cmid:1\r\nm=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=recvonly\r\na=mid:1\r\n")
    dialog = (f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-b{index}-{{m}};rport\r\n"
              f"From: <sip:bench@127.0.0.1>;tag=b{port}\r\nTo: {{to}}\r\nCall-ID: bench-{port}-{index}\r\n"
              "CSeq: {cseq} {m}\r\nMax-Forwards: 70\r\n")
    target = ("127.0.0.1", sip_port)
    invite = (f"INVITE sip:tts@127.0.0.1:{sip_port} SIP/2.0\r\n"
              + dialog.format(m="INVITE", to="<sip:tts@127.0.0.1>", cseq=1)
              + f"Contact: <sip:bench@127.0.0.1:{port}>\r\nContent-Type: application/sdp\r\n"
              f"Content-Length: {len(sdp)}\r\n\r\n{sdp}")
    await loop.sock_sendto(sip, invite.encode(), target)
    while True:
        answer = (await asyncio.wait_for(loop.sock_recv(sip, 65535), 10)).decode()
        if not answer.startswith("SIP/2.0 1"):
            break
    if not answer.startswith("SIP/2.0 200"):
        raise SystemExit(f"session refused: {answer.splitlines()[0]}")
    to = re.search(r"^To: (.*)$", answer, re.MULTILINE).group(1).strip()
    for method, cseq in (("ACK", 1),):
        await loop.sock_sendto(sip, (f"{method} sip:tts@127.0.0.1:{sip_port} SIP/2.0\r\n"
                                     + dialog.format(m=method, to=to, cseq=cseq) + "Content-Length: 0\r\n\r\n")
                               .encode(), target)
    channel = re.search(r"a=channel:(\S+)", answer).group(1)
    control_port = int(re.search(r"m=application (\d+)", answer).group(1))
    reader, writer = await asyncio.open_connection("127.0.0.1", control_port)
    speak_at = time.monotonic()
    writer.write(mrcp_request("SPEAK", 1, channel, TEXT.encode()))
    await read_message(reader)
    await asyncio.wait_for(rtp.first.wait(), 30)
    first_rtp = rtp.arrivals[0]
    await asyncio.sleep(0.5)
    stop_at = time.monotonic()
    writer.write(mrcp_request("STOP", 2, channel))
    await read_message(reader)
    response_at = time.monotonic()
    await asyncio.sleep(0.3)
    last = max(at for at in rtp.arrivals)
    writer.close()
    await loop.sock_sendto(sip, (f"BYE sip:tts@127.0.0.1:{sip_port} SIP/2.0\r\n"
                                 + dialog.format(m="BYE", to=to, cseq=2) + "Content-Length: 0\r\n\r\n").encode(),
                           target)
    await asyncio.wait_for(loop.sock_recv(sip, 65535), 5)
    sip.close()
    transport.close()
    return {"call_id": f"bench-{port}-{index}", "speak_to_first_rtp_ms": (first_rtp - speak_at) * 1000,
            "stop_to_response_ms": (response_at - stop_at) * 1000,
            "stop_to_last_rtp_ms": max(0.0, last - stop_at) * 1000}


def summary(values: list[float]) -> dict:
    ordered = sorted(values)
    return {"p50": round(statistics.median(ordered), 1),
            "p95": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 1),
            "max": round(ordered[-1], 1)}


async def rounds_on_own_serve(args) -> list[dict]:
    """Start serve with MRCP on (the built-in config or --config), run the rounds, stop it."""
    sip_port, http_port, mrcp_port = free_port(), free_port(socket.SOCK_STREAM), free_port(socket.SOCK_STREAM)
    command = [sys.executable, "-m", "gateway.cli", "serve", "--sip-listen", f"127.0.0.1:{sip_port}",
               "--http-listen", f"127.0.0.1:{http_port}", "--set", "sip.transports=[udp]",
               "--set", "mrcp.enabled=true", "--set", f"mrcp.listen=127.0.0.1:{mrcp_port}"]
    if args.config:
        command += ["--config", args.config]
    for setting in args.set:
        command += ["--set", setting]
    log = open(ROOT / "bench" / "results" / "mrcp_serve.log", "wb")
    serve = await asyncio.create_subprocess_exec(*command, cwd=ROOT, stdout=log, stderr=log,
                                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        for _ in range(600):
            await asyncio.sleep(0.5)
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", http_port)
                writer.write(b"GET /healthz HTTP/1.0\r\n\r\n")
                if b" 200 " in (await reader.readline()):
                    writer.close()
                    break
                writer.close()
            except OSError:
                continue
        return [await one_round(sip_port, index) for index in range(args.rounds)]
    finally:
        serve.terminate()
        await serve.wait()
        log.close()
        (ROOT / "bench" / "results" / "mrcp_serve.log").unlink(missing_ok=True)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--config", help="a gateway config (default: the built-in one, espeak)")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE passed to serve")
    parser.add_argument("--sip-port", type=int, help="a gateway already serving MRCP on loopback (its SIP port): "
                                                      "measure it instead of starting one")
    parser.add_argument("--engine-log", type=Path, help="that gateway's JSON log: each SPEAK's engine first chunk")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.sip_port:
        log_offset = args.engine_log.stat().st_size if args.engine_log else 0
        rounds = [await one_round(args.sip_port, index) for index in range(args.rounds)]
    else:
        rounds = await rounds_on_own_serve(args)
    ids = [r.pop("call_id") for r in rounds]
    engine = {}
    if args.sip_port and args.engine_log:
        await asyncio.sleep(1.0)  # a stopped job logs at its decode loop's next turn
        events, _ = job_events(args.engine_log, log_offset)
        engine = {e["call_id"]: 1000 * e["first_chunk_s"] for e in events if e.get("call_id") in ids}
    report = {"command": " ".join(["python", "bench/bench_mrcp.py", *sys.argv[1:]]),
              "engine": args.config or ("a running serve" if args.sip_port else "espeak (built-in config)"), "rounds": args.rounds,
              "loadavg_1m": round(os.getloadavg()[0], 2),
              **{key: summary([r[key] for r in rounds]) for key in rounds[0]}}
    if engine:  # the engine's own first chunk of the same SPEAKs, and what the MRCP path adds to it
        report["engine_first_chunk_ms"] = summary(list(engine.values()))
        report["speak_to_first_rtp_less_engine_ms"] = summary(
            [r["speak_to_first_rtp_ms"] - engine[i] for r, i in zip(rounds, ids) if i in engine])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    asyncio.run(main())
