"""A whole gateway in the test's event loop, a real SIPp caller, and an RTP socket that records what arrives."""

from __future__ import annotations

import asyncio
import shutil
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engines.registry import create_engine
from gateway.app import Gateway
from gateway.config import load_config
from gateway.engine_watchdog import WatchdogSettings
from gateway.media.g722 import G722Decoder
from speech_audio import g711
from tests.gateway.sip.peers import free_media_port

SCENARIOS = Path(__file__).parent / "sipp"
SIP_SCENARIOS = Path(__file__).parent.parent / "sipp"


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def start_gateway(engine: str = "espeak", t1_ms: int = 50, engine_settings: dict | None = None,
                        extra: dict | None = None, engine_obj=None, watchdog: WatchdogSettings | None = None
                        ) -> Gateway:
    """A gateway on loopback with ephemeral SIP port; `engine_obj` runs a ready-made engine instead."""
    overrides = {"sip.listen": "127.0.0.1:0", "sip.t1_ms": t1_ms, "sip.transports": ["udp"],
                 "media.rtp_port_range": "41000-42999", "engine.name": engine, **(extra or {})}
    if engine_settings:
        overrides[f"engine.{engine}"] = engine_settings
    config = load_config(None, overrides)
    engine_obj = engine_obj or create_engine(config.engine.name, config.engine_settings())
    gateway = Gateway(engine_obj, config.sip_settings(), config.media_settings(),
                      config.prompt_resolver(engine_obj.default_voice), watchdog or WatchdogSettings(),
                      mrcp_settings=config.mrcp_settings(), speech_settings=config.speech_settings())
    await gateway.start()
    return gateway


@dataclass
class RtpPacketSeen:
    at: float
    marker: bool
    payload_type: int
    seq: int
    timestamp: int
    ssrc: int
    payload: bytes


@dataclass
class RtpRecorder(asyncio.DatagramProtocol):
    """The caller's RTP port: keeps every packet with its arrival time (monotonic)."""

    packets: list[RtpPacketSeen] = field(default_factory=list)
    sources: list[tuple[str, int]] = field(default_factory=list)  # where RTP came from, first-seen order
    transport: asyncio.DatagramTransport | None = None
    arrived: asyncio.Event = field(default_factory=asyncio.Event)  # set by every packet

    def datagram_received(self, data: bytes, addr) -> None:
        if len(data) < 12 or data[0] >> 6 != 2:
            return
        if addr[:2] not in self.sources:
            self.sources.append(addr[:2])
        seq, stamp, ssrc = struct.unpack("!HII", data[2:12])
        self.packets.append(RtpPacketSeen(time.monotonic(), bool(data[1] & 0x80), data[1] & 0x7F, seq, stamp,
                                          ssrc, data[12:]))
        self.arrived.set()

    async def wait_for_packets(self, count: int = 1, timeout_s: float = 10.0) -> None:
        """Until `count` packets have arrived in all (TimeoutError after `timeout_s`): woken by each packet."""
        async def enough() -> None:
            while len(self.packets) < count:
                self.arrived.clear()
                await self.arrived.wait()

        await asyncio.wait_for(enough(), timeout_s)

    @property
    def port(self) -> int:
        return self.transport.get_extra_info("sockname")[1]

    def audio(self, codec: str) -> np.ndarray:
        """What was heard, int16: at 8 kHz for G.711, 16 kHz for G.722 (decoded packet by packet, as a phone does)."""
        if codec == "G722":
            decoder = G722Decoder()
            return np.concatenate([decoder.decode(p.payload) for p in self.packets])
        payload = b"".join(p.payload for p in self.packets)
        return g711.decode(payload, codec)


async def rtp_recorder() -> RtpRecorder:
    transport, recorder = await asyncio.get_running_loop().create_datagram_endpoint(
        RtpRecorder, local_addr=("127.0.0.1", 0))
    recorder.transport = transport
    return recorder


async def run_sipp(scenario: Path, sip_address: tuple[str, int], workdir: Path, *, service: str = "1000",
                   keys: dict[str, str] | None = None, timeout_s: int = 30, trace_msg: bool = False
                   ) -> tuple[int, str]:
    """Run one call of a SIPp scenario; returns (exit code, error log text). `trace_msg` keeps every message
    SIPp sent and received in `workdir`/*_messages.log (see `sipp_messages`)."""
    if shutil.which("sipp") is None:
        raise RuntimeError("sipp not installed")
    command = ["sipp", f"{sip_address[0]}:{sip_address[1]}", "-sf", str(scenario), "-s", service, "-m", "1",
               "-t", "u1", "-i", "127.0.0.1", "-p", str(free_udp_port()), "-mp", str(free_media_port()),
               "-timeout", f"{timeout_s}s", "-timeout_error", "-trace_err", "-nostdin"]
    for key, value in (keys or {}).items():
        command += ["-key", key, value]
    if trace_msg:
        command += ["-trace_msg"]
    process = await asyncio.create_subprocess_exec(*command, cwd=workdir, stdout=asyncio.subprocess.DEVNULL,
                                                   stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), timeout_s + 10)
    errors = stderr.decode(errors="replace") + "".join(p.read_text(errors="replace") for p in workdir.glob("*errors*"))
    return process.returncode, errors


def sipp_messages(workdir: Path) -> str:
    """The message log of the `run_sipp(..., trace_msg=True)` calls made in `workdir`."""
    return "".join(p.read_text(errors="replace") for p in sorted(workdir.glob("*_messages.log")))


async def invite_final_response(sip_address: tuple[str, int], headers: dict[str, str | bytes], user: str = "1000",
                                timeout: float = 10.0) -> str:
    """Send one INVITE (PCMU offer) from a plain UDP socket and return the first final response's status line.
    A header value given as bytes is sent as it is (to send bytes that are not UTF-8)."""
    return (await invite_final_reply(sip_address, headers, user, timeout)).split("\r\n", 1)[0]


async def invite_final_reply(sip_address: tuple[str, int], headers: dict[str, str | bytes], user: str = "1000",
                             timeout: float = 10.0) -> str:
    """As invite_final_response, but the whole final response (status line, headers, body)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    sdp = "v=0\r\no=t 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n" \
          f"m=audio {free_udp_port()} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"
    extra = b"".join(name.encode() + b": " + (value if isinstance(value, bytes) else value.encode()) + b"\r\n"
                     for name, value in headers.items())
    request = (f"INVITE sip:{user}@{sip_address[0]}:{sip_address[1]} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-it-{port};rport\r\n"
               f"From: <sip:test@127.0.0.1>;tag=it{port}\r\nTo: <sip:{user}@127.0.0.1>\r\n"
               f"Call-ID: it-{port}@127.0.0.1\r\nCSeq: 1 INVITE\r\nContact: <sip:test@127.0.0.1:{port}>\r\n"
               f"Max-Forwards: 70\r\n").encode() + extra + (f"Content-Type: application/sdp\r\n"
               f"Content-Length: {len(sdp)}\r\n\r\n{sdp}").encode()
    try:
        await loop.sock_sendto(sock, request, sip_address)
        while True:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65535), timeout)
            if not data.startswith(b"SIP/2.0 1"):
                return data.decode(errors="replace")
    finally:
        sock.close()


async def options_status(sip_address: tuple[str, int], timeout: float = 5.0) -> str:
    """Send one out-of-dialog OPTIONS (a proxy's qualify ping) and return the response's status line."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    port = sock.getsockname()[1]
    request = (f"OPTIONS sip:{sip_address[0]}:{sip_address[1]} SIP/2.0\r\n"
               f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-op-{port};rport\r\n"
               f"From: <sip:probe@127.0.0.1>;tag=op{port}\r\nTo: <sip:{sip_address[0]}>\r\n"
               f"Call-ID: op-{port}@127.0.0.1\r\nCSeq: 1 OPTIONS\r\nMax-Forwards: 70\r\n"
               f"Content-Length: 0\r\n\r\n").encode()
    try:
        await loop.sock_sendto(sock, request, sip_address)
        data = await asyncio.wait_for(loop.sock_recv(sock, 65535), timeout)
        return data.split(b"\r\n", 1)[0].decode()
    finally:
        sock.close()
