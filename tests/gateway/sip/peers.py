"""The peers the SIP tests talk to: a test call layer (`Phone`) that accepts or rejects, a raw UDP
endpoint for hand-written datagrams, and a runner for the real SIPp binary."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

from gateway.sip.message import SipResponse, parse
from gateway.sip.uas import Ended, InboundCall

SCENARIOS = Path(__file__).resolve().parents[2] / "sipp"
T1 = 0.05

ANSWER_SDP = (
    "v=0\r\no=gateway 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
    "m=audio 40000 RTP/AVP 0 101\r\na=rtpmap:0 PCMU/8000\r\na=rtpmap:101 telephone-event/8000\r\n"
    "a=sendrecv\r\n"
)


def answer_for(offer: str) -> str:
    """The test call layer's re-offer answer: mirror hold (sendonly -> recvonly)."""
    return ANSWER_SDP.replace("a=sendrecv", "a=recvonly") if "a=sendonly" in offer else ANSWER_SDP


class Phone:
    """A stand-in for the call layer: answers each INVITE per `policy` and records events."""

    def __init__(self, policy: str = "accept") -> None:
        self.policy = policy  # accept | ring | early | accept_later | reject_486 | hangup_after_ack
        self.calls: list[InboundCall] = []
        self.events: dict[str, list[object]] = {}
        self._done: dict[str, asyncio.Future[Ended]] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def on_invite(self, call: InboundCall) -> None:
        self.calls.append(call)
        self.events[call.call_id] = []
        self._done[call.call_id] = asyncio.get_running_loop().create_future()
        call.offer_handler = answer_for
        task = asyncio.get_running_loop().create_task(self._follow(call))
        self._tasks.add(task)
        if self.policy in ("accept", "hangup_after_ack"):
            call.accept(ANSWER_SDP)
        elif self.policy == "ring":
            call.ring()
        elif self.policy == "early":
            call.progress(ANSWER_SDP)
        elif self.policy == "accept_later":
            asyncio.get_running_loop().call_later(6 * T1, call.accept, ANSWER_SDP)
        elif self.policy == "reject_486":
            call.reject(486, "Busy Here")

    async def _follow(self, call: InboundCall) -> None:
        while True:
            event = await call.events.get()
            self.events[call.call_id].append(event)
            if self.policy == "hangup_after_ack" and not isinstance(event, Ended):
                call.hangup()
            if isinstance(event, Ended):
                self._done[call.call_id].set_result(event)
                return

    async def ended(self, call: InboundCall, timeout: float = 8.0) -> Ended:
        return await asyncio.wait_for(asyncio.shield(self._done[call.call_id]), timeout)


class UdpPeer(asyncio.DatagramProtocol):
    """A bare UDP endpoint for hand-written datagrams (garbage, malformed and minimal requests)."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()
        self.transport: asyncio.DatagramTransport | None = None

    def datagram_received(self, data: bytes, addr: tuple) -> None:
        self.inbox.put_nowait(data)

    @property
    def port(self) -> int:
        assert self.transport is not None
        return self.transport.get_extra_info("sockname")[1]

    def send(self, data: bytes, address: tuple[str, int]) -> None:
        assert self.transport is not None
        self.transport.sendto(data, address)

    async def response(self, timeout: float = 2.0) -> SipResponse:
        message = parse(await asyncio.wait_for(self.inbox.get(), timeout))
        assert isinstance(message, SipResponse), message
        return message


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _above_ephemeral_ports() -> range:
    """UDP ports the kernel never hands out for a bind to port 0 (above net.ipv4.ip_local_port_range), where
    only an explicit bind can take one; empty if that range ends too near 65535."""
    try:
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return range(0)
    return range(high + 1 + (high + 1) % 2, 65535 - 4, 2) if 65535 - high > 200 else range(0)


def free_media_port() -> int:
    """A port for SIPp's `-mp`: SIPp binds it and the next three (audio RTP/RTCP, video RTP/RTCP), so all four
    must be free, or it fails with "Address already in use" when another process took port + 2. Taken above
    the kernel's ephemeral range where there is one: between this probe and SIPp's bind, any socket bound to
    port 0 (a recorder, a gateway's client socket) could take an ephemeral one (seen in a clean-clone CI run:
    "Unable to bind video RTP socket ... errno = 98")."""
    above = _above_ephemeral_ports()
    for _ in range(50):
        base = random.choice(above) if above else _free_port() & ~1
        probes = []
        try:
            for port in range(base, base + 4):
                probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                probes.append(probe)
                probe.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for probe in probes:
                probe.close()
    raise RuntimeError("no four free UDP ports in a row for SIPp's media")


class Sipp:
    """Runs the real `sipp` binary against a server address and returns its exit code."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir

    async def run(self, scenario: str, address: tuple[str, int], *, transport: str = "u1",
                  service: str = "1000", calls: int = 1, timeout_s: int = 10,
                  extra: tuple[str, ...] = ()) -> int:
        command = [
            "sipp", f"{address[0]}:{address[1]}", "-sf", str(SCENARIOS / scenario), "-s", service,
            "-m", str(calls), "-t", transport, "-i", "127.0.0.1", "-p", str(_free_port()),
            "-mp", str(free_media_port()), "-timeout", f"{timeout_s}s", "-timeout_error", "-trace_err",
            "-nostdin", "-max_recv_loops", "1000", *extra,
        ]
        process = await asyncio.create_subprocess_exec(
            *command, cwd=self.workdir, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        _, stderr = await asyncio.wait_for(process.communicate(), timeout_s + 5)
        self.last_errors = stderr.decode(errors="replace") + "".join(
            path.read_text(errors="replace") for path in self.workdir.glob("*_errors.log"))
        return process.returncode if process.returncode is not None else -1


def raw_request(method: str, port: int, *, call_id: str = "raw-call-1", branch: str = "z9hG4bK-raw-1",
                cseq: int = 1, to_tag: str | None = None, body: str = "", user: str = "1000",
                extra: str = "") -> bytes:
    """A minimal valid request from a UdpPeer on `port` (tests mutate its bytes to break it)."""
    to = f"<sip:{user}@127.0.0.1>" + (f";tag={to_tag}" if to_tag else "")
    content_type = "Content-Type: application/sdp\r\n" if body else ""
    return (
        f"{method} sip:{user}@127.0.0.1 SIP/2.0\r\n"
        f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch={branch};rport\r\n"
        f"From: <sip:raw@127.0.0.1>;tag=raw-tag\r\nTo: {to}\r\nCall-ID: {call_id}\r\n"
        f"CSeq: {cseq} {method}\r\nContact: <sip:raw@127.0.0.1:{port}>\r\nMax-Forwards: 70\r\n"
        f"{extra}{content_type}Content-Length: {len(body.encode())}\r\n\r\n{body}"
    ).encode()


async def udp_peer(host: str = "127.0.0.1") -> UdpPeer:
    """A UdpPeer bound to `host` (127.0.0.x stand for distinct sources)."""
    transport, peer = await asyncio.get_running_loop().create_datagram_endpoint(UdpPeer, local_addr=(host, 0))
    peer.transport = transport
    return peer
