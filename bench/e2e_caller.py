"""The callers of bench_e2e_calls.py: raw-SIP calls placed from caller processes, RTP timed by the kernel.

Each call has its own SIP socket (asyncio UDP) and RTP socket. The RTP socket carries SO_TIMESTAMPNS, so an
arrival time is when the kernel queued the datagram, not when this process's event loop got round to it: at
500 calls (25,000 packets/s) one Python receiver falls behind and would charge its own lateness to the gateway.
The socket's receive buffer is large enough that a late reader loses nothing; a packet lost all the same shows
as an RTP sequence gap. Those timestamps are CLOCK_REALTIME, so the INVITE's send time is time.time_ns() too.

`place_schedule` spreads planned calls (when, whom, hang up when) over spawned caller processes and returns
every call's `CallResult`; `place_calls` is its constant rate (call i at start + i/rate). This module never
starts or reads the gateway.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import socket
import struct
import time
from array import array
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from audible import g711_audible

SO_TIMESTAMPNS = getattr(socket, "SO_TIMESTAMPNS", 35)  # Linux; SCM_TIMESTAMPNS has the same value
RTP_RCVBUF_BYTES = 1 << 20  # ~1,000 queued packets of one call (20 s of audio): a late reader loses nothing
_TIMESPEC = struct.Struct("@ll")  # struct timespec: two native longs
_ANCBUF = socket.CMSG_SPACE(_TIMESPEC.size)
_SILENCE = {0: b"\xff\x7f", 8: b"\xd5\x55"}  # PCMU / PCMA codes of +0 and -0 (G.711 tables)


@dataclass
class CallResult:
    """One caller: what it heard and when (nanoseconds of CLOCK_REALTIME)."""

    index: int
    status: int = 0
    reason: str = ""
    invite_ns: int = 0
    first_speech_ns: int | None = None  # first payload that is not all G.711 zero codes
    first_audible_ns: int | None = None  # first payload at or over audible.AUDIBLE_DBFS
    arrivals_ns: array = field(default_factory=lambda: array("q"))
    lost: int = 0  # packets missing from the RTP sequence numbers
    call_id: str = ""  # the SIP Call-ID (the engine's job logs carry it as call_id)
    bye_ns: int | None = None  # when the gateway's BYE arrived (time.time_ns(), as read)
    answered_by: str = ""  # HOST:PORT of the 200's Contact: which gateway took the call (behind a proxy too)


class RtpReceiver:
    """One call's RTP socket, every datagram stamped by the kernel as it arrived."""

    def __init__(self, result: CallResult, loop: asyncio.AbstractEventLoop) -> None:
        self._result = result
        self._loop = loop
        self._last_seq: int | None = None
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RTP_RCVBUF_BYTES)
        self.sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]
        loop.add_reader(self.sock.fileno(), self._drain)

    def _drain(self) -> None:
        """Everything queued, per wake-up: one loop turn per datagram would add the loop's delays to the queue."""
        result = self._result
        while True:
            try:
                data, ancillary, _flags, _addr = self.sock.recvmsg(2048, _ANCBUF)
            except BlockingIOError:
                return
            if 192 <= data[1] <= 223:
                # RTCP (RFC 5761 §4): the gateway sends another call's to its RTP port + 1 (RFC 3550 §11), and
                # ports are ephemeral here, so that is at times this socket
                continue
            seconds, nanoseconds = _TIMESPEC.unpack(ancillary[0][2])
            at = seconds * 1_000_000_000 + nanoseconds
            result.arrivals_ns.append(at)
            seq = int.from_bytes(data[2:4], "big")
            if self._last_seq is not None:
                step = (seq - self._last_seq) & 0xFFFF  # modulo 2^16 (RFC 3550 §A.1)
                if 1 < step < 0x8000:
                    result.lost += step - 1
            self._last_seq = seq
            # strip() leaves nothing only when every byte is a silence code: C speed, however long the payload
            if result.first_speech_ns is None and data[12:].strip(_SILENCE.get(data[1] & 0x7F, _SILENCE[0])):
                result.first_speech_ns = at
            if result.first_speech_ns is not None and result.first_audible_ns is None \
                    and g711_audible(data[12:], data[1] & 0x7F):
                result.first_audible_ns = at

    def close(self) -> None:
        self._loop.remove_reader(self.sock.fileno())
        self.sock.close()


class _Sip(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.inbox: asyncio.Queue[bytes] = asyncio.Queue()

    def datagram_received(self, data: bytes, addr) -> None:
        self.inbox.put_nowait(data)


def _headers(message: bytes) -> dict[str, str]:
    lines = message.split(b"\r\n\r\n", 1)[0].decode(errors="replace").split("\r\n")
    return {line.split(":", 1)[0].strip().lower(): line.split(":", 1)[1].strip() for line in lines[1:] if ":" in line}


def _host_port(contact: str) -> str:
    """HOST:PORT of a Contact header's SIP URI (`<sip:user@host:port;params>`)."""
    uri = contact[contact.find("<") + 1:contact.find(">")] if "<" in contact else contact
    return uri.split(":", 1)[-1].split("@")[-1].split(";", 1)[0]


def _dialog_target(answer: dict[str, str], target: str) -> tuple[str, str]:
    """The Request-URI and Route header of the dialog's requests from its 2xx (RFC 3261 §12.1.2): the remote
    Contact, and the Record-Route set reversed. Without Record-Route (no proxy, or one that did not record),
    the requests go where the INVITE went, as before."""
    record_route = answer.get("record-route", "")
    if not record_route:
        return target, ""
    contact = answer.get("contact", "")
    uri = contact[contact.find("<") + 1:contact.find(">")] if "<" in contact else contact.split(";", 1)[0]
    routes = ", ".join(reversed([r.strip() for r in record_route.split(",")]))
    return uri or target, f"Route: {routes}\r\n"


async def place_call(index: int, sip: tuple[str, int], user: str, timeout_s: float,
                     hang_up_after_s: float | None = None) -> CallResult:
    """INVITE, ACK the final answer, then hear the prompt until the gateway's BYE (answered with 200);
    with `hang_up_after_s`, the caller hangs up (BYE) that long after the first speech instead."""
    loop = asyncio.get_running_loop()
    call = CallResult(index)
    sip_transport, sip_proto = await loop.create_datagram_endpoint(_Sip, local_addr=("127.0.0.1", 0))
    rtp = RtpReceiver(call, loop)
    port = sip_transport.get_extra_info("sockname")[1]
    call_id, tag, branch = f"e2e-{index}-{port}@127.0.0.1", f"t{port}", f"z9hG4bK-e2e-{index}-{port}"
    call.call_id = call_id
    sdp = (f"v=0\r\no=e2e 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
           f"m=audio {rtp.port} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\na=ptime:20\r\n")
    common = (f"From: <sip:e2e@127.0.0.1>;tag={tag}\r\nCall-ID: {call_id}\r\nMax-Forwards: 70\r\n")
    invite = (f"INVITE sip:{user}@{sip[0]}:{sip[1]} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch={branch};rport\r\n"
              f"{common}To: <sip:{user}@{sip[0]}>\r\nCSeq: 1 INVITE\r\nContact: <sip:e2e@127.0.0.1:{port}>\r\n"
              f"Content-Type: application/sdp\r\nContent-Length: {len(sdp)}\r\n\r\n{sdp}").encode()
    target, route = f"sip:{user}@{sip[0]}:{sip[1]}", ""  # the in-dialog Request-URI and Route header
    try:
        deadline = time.monotonic() + timeout_s
        call.invite_ns = time.time_ns()  # the kernel's receive timestamps are CLOCK_REALTIME
        sip_transport.sendto(invite, sip)
        while True:  # the final answer to the INVITE
            data = await asyncio.wait_for(sip_proto.inbox.get(), max(deadline - time.monotonic(), 0.01))
            if not data.startswith(b"SIP/2.0 "):
                continue
            code = int(data[8:11])
            if code < 200:
                continue
            call.status, call.reason = code, data.split(b"\r\n", 1)[0][12:].decode(errors="replace")
            answer = _headers(data)
            to_header = answer.get("to", "")
            if code < 300:  # the dialog's requests follow its route set (a proxy that recorded its route)
                target, route = _dialog_target(answer, target)
                call.answered_by = _host_port(answer.get("contact", ""))
            ack_branch = branch if code >= 300 else branch + "-ack"  # RFC 3261 §17.1.1.3 / §13.2.2.4
            sip_transport.sendto((f"ACK {target} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};"
                                  f"branch={ack_branch};rport\r\n{common}To: {to_header}\r\n{route}CSeq: 1 ACK\r\n"
                                  f"Content-Length: 0\r\n\r\n").encode(), sip)
            break
        if call.status != 200:
            return call
        while True:  # the gateway hangs up after its prompt (or this caller does, with hang_up_after_s)
            if (hang_up_after_s is not None and call.first_speech_ns is not None
                    and time.time_ns() - call.first_speech_ns >= hang_up_after_s * 1e9):
                sip_transport.sendto((f"BYE {target} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};"
                                      f"branch={branch}-bye;rport\r\n{common}To: {to_header}\r\n{route}CSeq: 2 BYE\r\n"
                                      f"Content-Length: 0\r\n\r\n").encode(), sip)
                return call
            wait = max(deadline - time.monotonic(), 0.01)
            if hang_up_after_s is not None:
                wait = min(wait, 0.05)  # look at the first speech's age again soon
            try:
                data = await asyncio.wait_for(sip_proto.inbox.get(), wait)
            except asyncio.TimeoutError:
                if hang_up_after_s is None or time.monotonic() >= deadline:
                    raise
                continue
            if data.startswith(b"BYE "):
                call.bye_ns = time.time_ns()
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
        rtp.close()


@dataclass(frozen=True)
class PlannedCall:
    """One call of a schedule: placed `at_s` after the start, to `user`; `hang_up_after_s` as place_call's; `sip`: to
    that gateway instead of the schedule's (several gateway processes on one host)."""

    index: int
    at_s: float
    user: str = "bench"
    hang_up_after_s: float | None = None
    sip: tuple[str, int] | None = None


async def _place_share(sip: tuple[str, int], share: list[PlannedCall], start_at: float,
                       timeout_s: float) -> list[CallResult]:
    tasks = []
    for planned in share:  # a schedule for the caller, not media pacing
        await asyncio.sleep(max(0.0, start_at + planned.at_s - time.time()))
        tasks.append(asyncio.create_task(place_call(planned.index, planned.sip or sip, planned.user, timeout_s,
                                                    planned.hang_up_after_s)))
    return list(await asyncio.gather(*tasks))


def _caller_process(pipe: Connection, sip: tuple[str, int], share: list[PlannedCall], timeout_s: float) -> None:
    pipe.send("ready")  # imported: the start time the parent sends next no longer pays for process start-up
    start_at = pipe.recv()
    pipe.send(asyncio.run(_place_share(sip, share, start_at, timeout_s)))


def place_schedule(schedule: list[PlannedCall], processes: int, sip: tuple[str, int],
                   timeout_s: float) -> tuple[float, list[CallResult]]:
    """The planned calls (in time order) from `processes` spawned callers, interleaved (blocking); returns the
    start time (time.time()) and the results in index order."""
    context = multiprocessing.get_context("spawn")  # never fork a process that may hold a running loop
    pipes, children = [], []
    for share in range(processes):
        here, there = context.Pipe()
        child = context.Process(target=_caller_process, daemon=True,
                                args=(there, sip, schedule[share::processes], timeout_s))
        child.start()
        pipes.append(here)
        children.append(child)
    for pipe in pipes:
        pipe.recv()
    start_at = time.time() + 0.1
    for pipe in pipes:
        pipe.send(start_at)
    results = [result for pipe in pipes for result in pipe.recv()]
    for child in children:
        child.join()
    return start_at, sorted(results, key=lambda r: r.index)


def place_calls(calls: int, processes: int, rate: float, sip: tuple[str, int],
                timeout_s: float) -> tuple[float, list[CallResult]]:
    """One step's calls at a constant `rate` (call i at start + i/rate), as `place_schedule`."""
    return place_schedule([PlannedCall(i, i / rate) for i in range(calls)], processes, sip, timeout_s)
