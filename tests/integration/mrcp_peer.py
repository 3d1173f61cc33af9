"""An MRCPv2 client for tests: raw SIP over UDP for the session, raw TCP for the control connection, an RTP
socket for the audio; and `umc`, UniMRCP's real client, run in a private copy of its configuration."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from integration_harness import RtpRecorder, rtp_recorder

_ROOT = Path(__file__).resolve().parents[2]
# The UniMRCP client (../shared/tools/unimrcp beside the checkout, see its README), or $UNIMRCP_DIR.
UNIMRCP = next((path for path in (Path(os.environ.get("UNIMRCP_DIR", "/nonexistent")),
                                  _ROOT.parent / "shared" / "tools" / "unimrcp", _ROOT / "shared" / "tools" / "unimrcp",
                                  Path("/work/shared/tools/unimrcp")) if path.exists()), Path("/nonexistent"))


def _free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# -- raw SIP -----------------------------------------------------------------------------------------
def mrcp_offer(rtp_port: int, connection: str = "new", proto: str = "TCP/MRCPv2") -> str:
    return ("v=0\r\no=test 0 0 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=application 9 {proto} 1\r\na=setup:active\r\na=connection:{connection}\r\n"
            "a=resource:speechsynth\r\na=cmid:1\r\n"
            f"m=audio {rtp_port} RTP/AVP 0 8 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:8 PCMA/8000\r\n"
            "a=rtpmap:101 telephone-event/8000\r\na=fmtp:101 0-15\r\na=recvonly\r\na=ptime:20\r\na=mid:1\r\n")


@dataclass
class SipLeg:
    sock: socket.socket
    sip_address: tuple[str, int]
    port: int
    status: str
    answer: str
    to_header: str

    @property
    def channel(self) -> str:
        return re.search(r"a=channel:(\S+)", self.answer).group(1)

    @property
    def control_port(self) -> int:
        return int(re.search(r"m=application (\d+) TCP/(?:TLS/)?MRCPv2", self.answer).group(1))

    def _request(self, method: str, cseq: int) -> bytes:
        return (f"{method} sip:mrcp@{self.sip_address[0]}:{self.sip_address[1]} SIP/2.0\r\n"
                f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch=z9hG4bK-{method}-{self.port}-{cseq};rport\r\n"
                f"From: <sip:test@127.0.0.1>;tag=mt{self.port}\r\nTo: {self.to_header}\r\n"
                f"Call-ID: mrcp-{self.port}@127.0.0.1\r\nCSeq: {cseq} {method}\r\nMax-Forwards: 70\r\n"
                "Content-Length: 0\r\n\r\n").encode()

    async def wait_for_bye(self, timeout: float) -> None:
        """Until the gateway's BYE arrives (answered 200, as a client would)."""
        loop = asyncio.get_running_loop()
        while True:
            data = (await asyncio.wait_for(loop.sock_recv(self.sock, 65535), timeout)).decode()
            if data.startswith("BYE "):
                head = data.split("\r\n\r\n", 1)[0].split("\r\n")[1:]
                keep = [h for h in head if h.split(":", 1)[0].lower() in ("via", "from", "to", "call-id", "cseq")]
                response = "SIP/2.0 200 OK\r\n" + "\r\n".join(keep) + "\r\nContent-Length: 0\r\n\r\n"
                await loop.sock_sendto(self.sock, response.encode(), self.sip_address)
                self.sock.close()
                return

    async def bye(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(self.sock, self._request("BYE", 2), self.sip_address)
        try:
            await asyncio.wait_for(loop.sock_recv(self.sock, 65535), 5)
        finally:
            self.sock.close()


async def invite(sip_address: tuple[str, int], rtp_port: int, connection: str = "new",
                 proto: str = "TCP/MRCPv2") -> SipLeg:
    """One INVITE with an MRCPv2 offer; returns the leg with its final status line (ACKed if 200)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    sdp = mrcp_offer(rtp_port, connection, proto)
    request = (f"INVITE sip:mrcp@{sip_address[0]}:{sip_address[1]} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-inv-{port};rport\r\n"
               f"From: <sip:test@127.0.0.1>;tag=mt{port}\r\nTo: <sip:mrcp@127.0.0.1>\r\n"
               f"Call-ID: mrcp-{port}@127.0.0.1\r\nCSeq: 1 INVITE\r\nContact: <sip:test@127.0.0.1:{port}>\r\n"
               f"Max-Forwards: 70\r\nContent-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}").encode()
    await loop.sock_sendto(sock, request, sip_address)
    while True:
        data = (await asyncio.wait_for(loop.sock_recv(sock, 65535), 10)).decode()
        status = data.split("\r\n", 1)[0]
        if not status.startswith("SIP/2.0 1"):
            break
    to_header = re.search(r"^To: (.*)$", data, re.MULTILINE | re.IGNORECASE).group(1).strip()
    leg = SipLeg(sock, sip_address, port, status, data.split("\r\n\r\n", 1)[1], to_header)
    if status.startswith("SIP/2.0 200"):
        await loop.sock_sendto(sock, leg._request("ACK", 1), sip_address)
    return leg


# -- raw MRCP -----------------------------------------------------------------------------------------
@dataclass
class Message:
    start: list[str]  # the start line's fields
    headers: dict[str, str]
    body: bytes
    at: float  # monotonic arrival

    @property
    def request_id(self) -> int:  # a response's second field, an event's third
        return int(self.start[2] if self.start[2].isdigit() else self.start[3])

    @property
    def status(self) -> int | None:
        return int(self.start[3]) if self.start[2].isdigit() else None

    @property
    def event(self) -> str | None:
        return None if self.start[2].isdigit() else self.start[2]

    @property
    def state(self) -> str:
        return self.start[-1]


class Control:
    """One TCP control connection."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def connect(cls, port: int, tls: bool = False) -> Control:
        context = None
        if tls:  # the test's self-signed certificate: encryption is what is tested, not the PKI
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return cls(*await asyncio.open_connection("127.0.0.1", port, ssl=context))

    def send_raw(self, data: bytes) -> None:
        self.writer.write(data)

    def send(self, method: str, request_id: int, channel: str | None, headers: dict[str, str] | None = None,
             body: bytes = b"", content_type: str | None = None, version: str = "MRCP/2.0") -> None:
        fields = dict(headers or {})
        if channel is not None:
            fields = {"Channel-Identifier": channel, **fields}
        if body:
            fields["Content-Type"] = content_type or "text/plain"
            fields["Content-Length"] = str(len(body))
        rest = "".join(f"{name}: {value}\r\n" for name, value in fields.items()).encode() + b"\r\n" + body
        length = len(rest)
        while len(f"{version} {length} {method} {request_id}\r\n") + len(rest) != length:
            length = len(f"{version} {length} {method} {request_id}\r\n") + len(rest)
        self.writer.write(f"{version} {length} {method} {request_id}\r\n".encode() + rest)

    async def read(self, timeout: float = 10.0) -> Message:
        line = await asyncio.wait_for(self.reader.readuntil(b"\r\n"), timeout)
        fields = line.decode().split()
        rest = await asyncio.wait_for(self.reader.readexactly(int(fields[1]) - len(line)), timeout)
        head, _, body = rest.partition(b"\r\n\r\n")
        headers = dict(h.split(": ", 1) for h in head.decode().split("\r\n") if h)
        return Message(fields, headers, body, time.monotonic())

    async def closed(self, timeout: float = 5.0) -> bool:
        try:
            return await asyncio.wait_for(self.reader.read(1), timeout) == b""
        except (ConnectionError, TimeoutError):
            return True

    def close(self) -> None:
        self.writer.close()


@dataclass
class Session:
    leg: SipLeg
    control: Control
    rtp: RtpRecorder

    @property
    def channel(self) -> str:
        return self.leg.channel

    async def close(self) -> None:
        self.control.close()
        self.rtp.transport.close()
        await self.leg.bye()


async def open_session(sip_address: tuple[str, int], tls: bool = False) -> Session:
    rtp = await rtp_recorder()
    leg = await invite(sip_address, rtp.port, proto="TCP/TLS/MRCPv2" if tls else "TCP/MRCPv2")
    assert leg.status.startswith("SIP/2.0 200"), leg.status
    return Session(leg, await Control.connect(leg.control_port, tls), rtp)


# -- UniMRCP's umc ------------------------------------------------------------------------------------
def umc_problem() -> str | None:
    """Why umc cannot run here (None: it can)."""
    binary = UNIMRCP / "bin" / "umc"
    if not binary.exists():
        return f"no UniMRCP client at {UNIMRCP}"
    probe = subprocess.run(["ldd", str(binary)], capture_output=True, text=True,
                           env={**os.environ, "LD_LIBRARY_PATH": str(UNIMRCP / "lib")})
    missing = [line.split()[0] for line in probe.stdout.splitlines() if "not found" in line
               and "libunimrcpclient" not in line]
    return f"umc needs {', '.join(missing)} (apt-get install libapr1 libaprutil1 libsofia-sip-ua0)" if missing else None


def umc_workdir(workdir: Path, sip_port: int) -> Path:
    """A private copy of umc's conf/ and data/, pointed at `sip_port`, on free client SIP and RTP ports."""
    shutil.copytree(UNIMRCP / "conf", workdir / "conf")
    shutil.copytree(UNIMRCP / "data", workdir / "data")
    for path in [*workdir.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    (workdir / "log").mkdir()
    (workdir / "var").mkdir()
    # The shipped lib/libunimrcpclient.so.0 may be a copied symlink (a text file): link it here.
    (workdir / "lib").mkdir()
    (workdir / "lib" / "libunimrcpclient.so.0").symlink_to(UNIMRCP / "lib" / "libunimrcpclient.so.0.8.0")
    profile = workdir / "conf" / "client-profiles" / "unimrcp.xml"
    profile.write_text(re.sub(r"<server-port>\d+</server-port>", f"<server-port>{sip_port}</server-port>",
                              profile.read_text()))
    client = workdir / "conf" / "unimrcpclient.xml"
    rtp_low = _free_port() & ~1
    text = re.sub(r"<sip-port>\d+</sip-port>", f"<sip-port>{_free_port()}</sip-port>", client.read_text())
    text = text.replace("<rtp-port-min>4000</rtp-port-min>", f"<rtp-port-min>{rtp_low}</rtp-port-min>")
    text = text.replace("<rtp-port-max>5000</rtp-port-max>", f"<rtp-port-max>{rtp_low + 20}</rtp-port-max>")
    client.write_text(text)
    return workdir


async def run_umc(workdir: Path, commands: list[str], seconds: float) -> str:
    """Run umc's console with `commands` (e.g. "run synth"), quit after `seconds`; returns its output."""
    process = await asyncio.create_subprocess_exec(
        str(UNIMRCP / "bin" / "umc"), "-r", str(workdir), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, "LD_LIBRARY_PATH": str(workdir / "lib")})
    for command in commands:
        process.stdin.write(command.encode() + b"\n")
        await process.stdin.drain()
        await asyncio.sleep(0.3)
    await asyncio.sleep(seconds)
    process.stdin.write(b"quit\n")
    await process.stdin.drain()
    output, _ = await asyncio.wait_for(process.communicate(), 15)
    return output.decode(errors="replace")
