"""SIP abuse benchmark: does a live call keep its 20 ms packet rhythm while someone abuses the SIP port?

Starts the gateway (`python -m gateway.cli serve`, a separate process with the common systemd soft limit
of 1,024 file descriptors), places one live call from 127.0.0.1 (a long prompt from the instant engine)
and records its RTP arrival times with kernel timestamps (SO_TIMESTAMPNS). Then, one phase at a time:

- `quiet`: nothing else happens (the reference interval max);
- `invite_flood`: 2,000 INVITE/s from 127.0.0.2 (to a number without a route) for `--flood-seconds`;
- `tcp_abuse`: 2,000 idle connections (from 127.0.1.1-20), 50 slowloris connections (one header byte a
  second) and 150 unfinished 1 MiB bodies, held `--hold-seconds`; afterwards, whether a UDP OPTIONS
  and /healthz are still answered, and how many of the abusive connections the gateway still holds;
- `crlf_keepalive`: one TCP connection (127.0.4.1) sends CRLFCRLF keep-alives as fast as it can and never
  reads, for `--phase-seconds` (or until the gateway closes it);
- `tcp_pipeline`: three TCP connections (127.0.5.1-3), one a second, each writes 2,000 INVITEs at once;
- `spoofed_trunk_junk`: 300 datagrams/s of random bytes carrying the trunk's address (127.0.0.9) while the
  trunk places an INVITE every 0.5 s: how many of the trunk's INVITEs get their real answer (404);
- `multi_source_flood`: 2,000 INVITE/s spread over 50 addresses (127.0.0.10-59) for `--flood-seconds`.

The load generator (this process) runs at nice 10, the gateway at 0. Per phase: the live call's RTP
interval p50/p99/max, the gateway's CPU seconds, RSS at the start, peak and end, and open file
descriptors. Loopback only, bounded in count and time. Runs against any source tree:

    python bench/bench_sip_abuse.py --label after
    python bench/bench_sip_abuse.py --tree /work/main --label before   # or a `git archive` of main

Each run is appended to its label's runs in bench/results/sip_abuse.json (delete the file to start over);
`--phases` runs a subset (quiet always runs first).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import random
import secrets
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "sip_abuse.json"
FLOOD_SOURCE = "127.0.0.2"
TRUNK_SOURCE = "127.0.0.9"
FLOOD_SOURCES = [f"127.0.0.{10 + i}" for i in range(50)]
NOTE = ("Loopback on a small host shared with other work while it ran (loadavg_1m per run): a bad interval may be "
        "someone else's. 'before' runs the same script against another tree (--tree), 'after' this one.")
PHASES = ("invite_flood", "tcp_abuse", "crlf_keepalive", "tcp_pipeline", "spoofed_trunk_junk", "multi_source_flood")
GATEWAY_NOFILE = 1024  # systemd's default soft limit (LimitNOFILE=1024:524288)
SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux value; Python does not export it


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gateway_config(sip_port: int, http_port: int) -> str:
    return f"""
sip:
  listen: "127.0.0.1:{sip_port}"
  max_calls: 100
trunks:
  - name: loopback
    allow: ["127.0.0.0/8"]
media:
  rtp_port_range: "40000-44000"
engine:
  name: instant
  instant:
    max_duration_s: 600
routes:
  - match: "live"
    text: "{'a live call that keeps talking ' * 40}"
    after: stay
http:
  listen: "127.0.0.1:{http_port}"
logging:
  level: warning
"""


# --- the gateway process ------------------------------------------------------------------------------

class GatewayProcess:
    def __init__(self, tree: Path, workdir: Path) -> None:
        self.sip_port, self.http_port = free_port(), free_port(socket.SOCK_STREAM)
        config = workdir / "gateway.yaml"
        config.write_text(gateway_config(self.sip_port, self.http_port))
        self.log_path = workdir / "gateway.log"
        env = {**os.environ, "PYTHONPATH": str(tree)}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--config", str(config)], cwd=tree, env=env,
            stdout=subprocess.DEVNULL, stderr=self.log_path.open("w"))
        # before it has imported anything, let alone opened a socket
        resource.prlimit(self.process.pid, resource.RLIMIT_NOFILE, (GATEWAY_NOFILE, GATEWAY_NOFILE))
        self.peak_rss_kib = 0
        self._sampling = True
        threading.Thread(target=self._sample_rss, daemon=True).start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.healthz(1.0) is not None:
                return
            time.sleep(0.2)  # start-up wait in a benchmark driver
        raise RuntimeError(f"gateway did not come up; log: {self.log_path.read_text()[-2000:]}")

    def healthz(self, timeout: float = 2.0) -> int | None:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=timeout).status
        except OSError:
            return None

    def metrics_text(self) -> str:
        try:
            return urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/metrics", timeout=5).read().decode()
        except OSError:
            return ""

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def open_fds(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/fd"))

    def _sample_rss(self) -> None:
        while self._sampling and self.process.poll() is None:
            try:
                self.peak_rss_kib = max(self.peak_rss_kib, self.rss_kib())
            except OSError:
                return
            time.sleep(0.1)

    def stop(self) -> None:
        self._sampling = False
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()


# --- the live call ------------------------------------------------------------------------------------

def sip_request(method: str, port: int, sip_port: int, *, user: str, call_id: str, branch: str, cseq: int,
                host: str = "127.0.0.1", to_tag: str | None = None, body: str = "") -> bytes:
    to = f"<sip:{user}@127.0.0.1>" + (f";tag={to_tag}" if to_tag else "")
    content_type = "Content-Type: application/sdp\r\n" if body else ""
    return (f"{method} sip:{user}@127.0.0.1:{sip_port} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP {host}:{port};branch=z9hG4bK{branch};rport\r\n"
            f"From: <sip:bench@{host}>;tag=bench\r\nTo: {to}\r\nCall-ID: {call_id}\r\n"
            f"CSeq: {cseq} {method}\r\nContact: <sip:bench@{host}:{port}>\r\nMax-Forwards: 70\r\n"
            f"{content_type}Content-Length: {len(body.encode())}\r\n\r\n{body}").encode()


def offer(host: str, rtp_port: int) -> str:
    return (f"v=0\r\no=bench 1 1 IN IP4 {host}\r\ns=-\r\nc=IN IP4 {host}\r\nt=0 0\r\n"
            f"m=audio {rtp_port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=sendrecv\r\n")


class LiveCall:
    """One answered call whose RTP arrival times are taken from the kernel (SO_TIMESTAMPNS)."""

    def __init__(self, sip_port: int) -> None:
        self.sip_port = sip_port
        self.sip = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sip.bind(("127.0.0.1", 0))
        self.sip.settimeout(5)
        self.rtp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.rtp.bind(("127.0.0.1", 0))
        self.rtp.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.rtp.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.arrivals: list[float] = []
        self._running = True

    def start(self) -> None:
        port = self.sip.getsockname()[1]
        self.sip.sendto(sip_request("INVITE", port, self.sip_port, user="live", call_id="live-call", branch="live1",
                                    cseq=1, body=offer("127.0.0.1", self.rtp.getsockname()[1])),
                        ("127.0.0.1", self.sip_port))
        while True:
            data = self.sip.recv(65535)
            status = int(data.split(b" ", 2)[1])
            if status >= 200:
                break
        if status != 200:
            raise RuntimeError(f"live call refused: {data[:200]!r}")
        to_tag = data.split(b"\r\nTo: ", 1)[1].split(b"\r\n", 1)[0].split(b"tag=", 1)[1].decode()
        self.sip.sendto(sip_request("ACK", port, self.sip_port, user="live", call_id="live-call", branch="live2",
                                    cseq=1, to_tag=to_tag), ("127.0.0.1", self.sip_port))
        threading.Thread(target=self._record, daemon=True).start()

    def _record(self) -> None:
        self.rtp.settimeout(0.5)
        while self._running:
            try:
                _, ancillary, _, _ = self.rtp.recvmsg(2048, 256)
            except TimeoutError:
                continue
            for level, kind, data in ancillary:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS:
                    seconds, nanos = struct.unpack("qq", data[:16])
                    self.arrivals.append(seconds + nanos / 1e9)

    def options_answered(self) -> bool:
        port = self.sip.getsockname()[1]
        self.sip.sendto(sip_request("OPTIONS", port, self.sip_port, user="live", call_id=secrets.token_hex(6),
                                    branch=secrets.token_hex(6), cseq=1), ("127.0.0.1", self.sip_port))
        try:
            return self.sip.recv(65535).startswith(b"SIP/2.0 200")
        except TimeoutError:
            return False

    def intervals_ms(self, start: float, end: float) -> dict:
        times = [t for t in self.arrivals if start <= t <= end]
        gaps = sorted((b - a) * 1000 for a, b in itertools.pairwise(times))
        if not gaps:
            return {"packets": len(times)}
        return {"packets": len(times), "interval_p50_ms": round(gaps[len(gaps) // 2], 2),
                "interval_p99_ms": round(gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))], 2),
                "interval_max_ms": round(gaps[-1], 2), "intervals_over_40ms": sum(gap > 40 for gap in gaps)}

    def stop(self) -> None:
        self._running = False


# --- the abuse ----------------------------------------------------------------------------------------

def flood(sip_port: int, rate: int, seconds: float, sources: list[str] = [FLOOD_SOURCE]) -> dict:
    """`rate` INVITEs a second, round robin over `sources`, paced in 10 ms batches; counts the answers."""
    sockets = []
    for source in sources:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind((source, 0))
        sock.setblocking(False)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20 if len(sources) == 1 else 1 << 20)
        sockets.append(sock)
    bodies = {source: offer(source, 9) for source in sources}
    answers: dict[str, int] = {}
    sent, start, batch = 0, time.monotonic(), rate // 100
    while (now := time.monotonic()) - start < seconds:
        due = int((now - start) * rate)
        while sent < due:
            sock = sockets[sent % len(sockets)]
            host, port = sock.getsockname()
            data = sip_request("INVITE", port, sip_port, user="nobody", call_id=f"flood-{sent}", branch=f"f{sent}",
                               cseq=1, host=host, body=bodies[host])
            try:
                sock.sendto(data, ("127.0.0.1", sip_port))
            except BlockingIOError:
                pass
            sent += 1
        for sock in sockets:
            _drain(sock, answers)
        time.sleep(0.01 if batch else 0.001)  # the flooder's own pacing, not the gateway's
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        for sock in sockets:
            _drain(sock, answers)
        time.sleep(0.05)
    for sock in sockets:
        sock.close()
    return {"invites_sent": sent, "sources": len(sources), "answers": answers}


def _waiting(sock: socket.socket):
    """The datagrams already received on a non-blocking socket."""
    while True:
        try:
            yield sock.recv(65535)
        except BlockingIOError:
            return


def _drain(sock: socket.socket, answers: dict[str, int]) -> None:
    for data in _waiting(sock):
        code = data[8:11].decode(errors="replace")
        answers[code] = answers.get(code, 0) + 1


def _connect_all(sources: list[str], port: int, deadline_s: float = 3.0) -> tuple[list[socket.socket], int]:
    """Non-blocking connects from each source; those not established within the deadline count as refused."""
    pending = []
    for source in sources:
        s = socket.socket()
        s.setblocking(False)
        s.bind((source, 0))
        s.connect_ex(("127.0.0.1", port))
        pending.append(s)
    connected, end = [], time.monotonic() + deadline_s
    poller = select.poll()
    by_fd = {s.fileno(): s for s in pending}
    for fd in by_fd:
        poller.register(fd, select.POLLOUT)
    while by_fd and time.monotonic() < end:
        for fd, _ in poller.poll(100):
            s = by_fd.pop(fd)
            poller.unregister(fd)
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0:
                connected.append(s)
            else:
                s.close()
    pending = list(by_fd.values())
    for s in pending:
        s.close()
    return connected, len(sources) - len(connected)


def _send_some(s: socket.socket, data: bytes) -> int:
    try:
        return s.send(data)
    except (BlockingIOError, OSError):
        return 0


def tcp_abuse(sip_port: int, hold_s: float) -> tuple[list[socket.socket], dict]:
    """2,000 idle, 50 slowloris, 150 unfinished 1 MiB bodies; returns the sockets and what happened."""
    idle, refused_idle = _connect_all([f"127.0.1.{1 + i % 20}" for i in range(2000)], sip_port)
    slow, refused_slow = _connect_all(["127.0.2.1"] * 50, sip_port)
    bodies, refused_bodies = _connect_all([f"127.0.3.{1 + i % 5}" for i in range(150)], sip_port)
    header = ("INVITE sip:live@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.2.1:5060;branch=z9hG4bKslow\r\n"
              "From: <sip:a@127.0.2.1>;tag=1\r\nTo: <sip:live@127.0.0.1>\r\nCall-ID: slow\r\nCSeq: 1 INVITE\r\n"
              "X-Padding: " + "x" * 2000 + "\r\n").encode()
    big = (b"INVITE sip:live@127.0.0.1 SIP/2.0\r\nVia: SIP/2.0/TCP 127.0.3.1:5060;branch=z9hG4bKbig\r\n"
           b"From: <sip:a@127.0.3.1>;tag=1\r\nTo: <sip:live@127.0.0.1>\r\nCall-ID: big\r\n"
           b"CSeq: 1 INVITE\r\nContent-Length: 1048576\r\n\r\n") + b"y" * (960 * 1024)  # 960 KiB of 1 MiB
    big_sent = {id(s): 0 for s in bodies}
    end = time.monotonic() + hold_s
    sent_byte = 0
    while time.monotonic() < end:
        for s in slow:
            _send_some(s, header[sent_byte:sent_byte + 1])
        sent_byte = min(sent_byte + 1, len(header) - 1)
        second = time.monotonic() + 1.0
        while time.monotonic() < second:  # push the bodies while pacing slowloris at one byte a second
            for s in bodies:
                big_sent[id(s)] += _send_some(s, big[big_sent[id(s)]:big_sent[id(s)] + 65536])
            time.sleep(0.05)
    # What the client sees: a connection still queued in the listen backlog (never accepted, so it holds
    # no gateway descriptor) looks as open as an accepted one; the gateway's own count is open_fds_*.
    still_open = {"idle": _open_count(idle), "slowloris": _open_count(slow), "bodies": _open_count(bodies)}
    return idle + slow + bodies, {
        "connected": {"idle": len(idle), "slowloris": len(slow), "bodies": len(bodies)},
        "not_connected": {"idle": refused_idle, "slowloris": refused_slow, "bodies": refused_bodies},
        "body_bytes_sent_mib": round(sum(big_sent.values()) / 2**20, 1),
        "client_sees_open_after_hold": still_open}


def _open_count(sockets: list[socket.socket]) -> int:
    count = 0
    for s in sockets:
        try:
            data = s.recv(65536, socket.MSG_DONTWAIT | socket.MSG_PEEK)
            count += data != b""
        except BlockingIOError:
            count += 1
        except OSError:
            pass
    return count


def crlf_keepalive(sip_port: int, seconds: float) -> dict:
    """CRLFCRLF pings as fast as the socket takes them, never reading a pong, from one source; a
    connection the gateway closes is opened again at once, as an attacker would."""
    pings = b"\r\n\r\n" * 16384
    sent, connections, refused, start = 0, 0, 0, time.monotonic()
    while time.monotonic() - start < seconds:
        try:
            s = socket.create_connection(("127.0.0.1", sip_port), timeout=1.0, source_address=("127.0.4.1", 0))
        except OSError:
            refused += 1
            time.sleep(0.01)
            continue
        connections += 1
        s.setblocking(False)
        while time.monotonic() - start < seconds:
            try:
                sent += s.send(pings)
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:  # closed by the gateway
                break
        s.close()
    return {"keepalive_bytes_sent_mib": round(sent / 2**20, 1), "connections_opened": connections,
            "connects_failed": refused}


def tcp_pipeline(sip_port: int, batches: int = 3, per_batch: int = 2000) -> dict:
    """`batches` connections, one a second, each writing `per_batch` INVITEs at once and reading answers."""
    answers: dict[str, int] = {}
    for n in range(batches):
        source = f"127.0.5.{n + 1}"
        s = socket.create_connection(("127.0.0.1", sip_port), source_address=(source, 0))
        port = s.getsockname()[1]
        body = offer(source, 9)
        data = b"".join(sip_request("INVITE", port, sip_port, user="nobody", call_id=f"pipe-{n}-{i}", host=source,
                                    branch=f"p{n}x{i}", cseq=1, body=body).replace(b"SIP/2.0/UDP", b"SIP/2.0/TCP")
                        for i in range(per_batch))
        s.setblocking(False)
        received, end = bytearray(), time.monotonic() + 1.0
        while data or time.monotonic() < end:
            try:
                data = data[s.send(data):] if data else data
            except BlockingIOError:
                pass
            except OSError:
                break
            try:
                chunk = s.recv(1 << 20)
                if not chunk:
                    break
                received += chunk
            except BlockingIOError:
                time.sleep(0.001)
            except OSError:
                break
        s.close()
        for line in bytes(received).split(b"\r\n"):
            if line.startswith(b"SIP/2.0 "):
                code = line[8:11].decode(errors="replace")
                answers[code] = answers.get(code, 0) + 1
    return {"connections": batches, "invites_per_write": per_batch, "answers": answers}


def spoofed_trunk_junk(sip_port: int, seconds: float, junk_rate: int = 300, invites: int = 11) -> dict:
    """Junk datagrams with the trunk's source address while the trunk places `invites` INVITEs, one every
    0.5 s from the start (the junk goes on for at least `seconds`)."""
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    junk.bind((TRUNK_SOURCE, 0))
    trunk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    trunk.bind((TRUNK_SOURCE, 0))
    trunk.setblocking(False)
    port = trunk.getsockname()[1]
    finals: dict[str, str] = {}
    rng = random.Random(31)
    placed, junk_sent, start = 0, 0, time.monotonic()
    while (elapsed := time.monotonic() - start) < seconds or placed < invites:
        while junk_sent < int(elapsed * junk_rate):
            junk.sendto(rng.randbytes(rng.randint(40, 400)), ("127.0.0.1", sip_port))
            junk_sent += 1
        if placed < min(invites, int(elapsed / 0.5) + 1):
            trunk.sendto(sip_request("INVITE", port, sip_port, user="nobody", call_id=f"trunk-{placed}",
                                     branch=f"t{placed}", cseq=1, host=TRUNK_SOURCE, body=offer(TRUNK_SOURCE, 9)),
                         ("127.0.0.1", sip_port))
            placed += 1
        _finals(trunk, finals)
        time.sleep(0.01)
    end = time.monotonic() + 1.0
    while time.monotonic() < end:
        _finals(trunk, finals)
        time.sleep(0.05)
    junk.close()
    trunk.close()
    codes = list(finals.values())
    return {"junk_sent": junk_sent, "trunk_invites": placed,
            "trunk_invites_answered": sum(code != "503" for code in codes),
            "trunk_finals": {code: codes.count(code) for code in sorted(set(codes))}}


def _finals(sock: socket.socket, finals: dict[str, str]) -> None:
    for data in _waiting(sock):
        code = data[8:11].decode(errors="replace")
        if code >= "200":
            call_id = data.split(b"\r\nCall-ID: ", 1)[1].split(b"\r\n", 1)[0].decode()
            finals[call_id] = code


# --- phases -------------------------------------------------------------------------------------------

def phase(name: str, gateway: GatewayProcess, call: LiveCall, action) -> dict:
    cpu0, wall0 = gateway.cpu_seconds(), time.monotonic()
    gateway.peak_rss_kib = gateway.rss_kib()
    rss0 = gateway.peak_rss_kib
    start = time.clock_gettime(time.CLOCK_REALTIME)
    detail = action()
    end = time.clock_gettime(time.CLOCK_REALTIME)
    wall = time.monotonic() - wall0
    cpu = gateway.cpu_seconds() - cpu0
    row = {"phase": name, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "cpu_cores": round(cpu / wall, 3),
           "rss_start_mib": round(rss0 / 1024, 1), "rss_peak_mib": round(gateway.peak_rss_kib / 1024, 1),
           "rss_end_mib": round(gateway.rss_kib() / 1024, 1),
           "open_fds_end": gateway.open_fds(), **call.intervals_ms(start, end), **(detail or {})}
    print(json.dumps(row), flush=True)
    return row


def run(tree: Path, flood_rate: int, flood_seconds: float, hold_seconds: float, phase_seconds: float,
        phases: tuple[str, ...]) -> dict:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        gateway = GatewayProcess(tree, Path(tmp))
        call = LiveCall(gateway.sip_port)
        held: list[socket.socket] = []
        # The abuse comes from this process. A real attacker uses another host's CPU; on a small shared
        # host, nice 10 keeps the load generator from taking the gateway's core (the gateway keeps nice 0).
        os.nice(10)

        def abuse() -> dict:
            sockets, detail = tcp_abuse(gateway.sip_port, hold_seconds)
            held.extend(sockets)
            detail["open_fds_during"] = gateway.open_fds()
            detail["udp_options_answered"] = call.options_answered()
            detail["healthz_status"] = gateway.healthz()
            return detail

        actions = {
            "invite_flood": lambda: flood(gateway.sip_port, flood_rate, flood_seconds),
            "tcp_abuse": abuse,
            "crlf_keepalive": lambda: crlf_keepalive(gateway.sip_port, phase_seconds),
            "tcp_pipeline": lambda: tcp_pipeline(gateway.sip_port),
            "spoofed_trunk_junk": lambda: spoofed_trunk_junk(gateway.sip_port, phase_seconds),
            "multi_source_flood": lambda: flood(gateway.sip_port, flood_rate, flood_seconds, FLOOD_SOURCES),
        }
        try:
            gateway.wait_ready()
            call.start()
            rows.append(phase("quiet", gateway, call, lambda: time.sleep(3.0)))
            for name in phases:
                rows.append(phase(name, gateway, call, actions[name]))
                for s in held:
                    s.close()
                held.clear()
                time.sleep(1.0)  # let what a phase left behind settle before the next one measures
            rows[-1]["options_answered_after"] = call.options_answered()
            log = gateway.log_path.read_text(errors="replace")
            rows.append({"phase": "totals", "gateway_log_lines": log.count("\n"),
                         "sip_requests_series": gateway.metrics_text().count("gateway_sip_requests_total{")})
        finally:
            call.stop()
            gateway.stop()
    # The host is shared: its load average says how much of a bad interval may be someone else's.
    commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    return {"tree": str(tree), "commit": commit, "host_cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0],
            "flood_rate_per_s": flood_rate,
            "flood_seconds": flood_seconds, "tcp_hold_seconds": hold_seconds, "phase_seconds": phase_seconds,
            "phases": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="live-call RTP, CPU and RSS under SIP abuse (loopback)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="source tree to run the gateway from")
    parser.add_argument("--label", default="after", help="key of this run in the results file")
    parser.add_argument("--flood-rate", type=int, default=2000)
    parser.add_argument("--flood-seconds", type=float, default=5.0)
    parser.add_argument("--hold-seconds", type=float, default=12.0)
    parser.add_argument("--phase-seconds", type=float, default=5.0, help="crlf_keepalive and spoofed_trunk_junk")
    parser.add_argument("--phases", default=",".join(PHASES), help=f"comma-separated subset of {','.join(PHASES)}")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    phases = tuple(name for name in args.phases.split(",") if name)
    unknown = set(phases) - set(PHASES)
    if unknown:
        parser.error(f"--phases: unknown {', '.join(sorted(unknown))}")
    result = run(args.tree.resolve(), args.flood_rate, args.flood_seconds, args.hold_seconds, args.phase_seconds,
                 phases)
    existing = json.loads(args.out.read_text()) if args.out.exists() else {}
    existing["note"] = NOTE
    existing.setdefault(args.label, {"runs": []})["runs"].append(result)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
