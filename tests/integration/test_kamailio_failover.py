"""Gateways behind Kamailio (sip_config/kamailio/), SIPp callers through it.

Failover: three `cosyvoice-gateway serve` processes in one dispatcher set, probed with OPTIONS every second.
When a gateway is full, killed or draining, new calls go to the others; with none left the caller gets 503 from
Kamailio. Every call that is answered is spoken to (RTP arrives) and ended with BYE: none is answered and left
silent.

One host, several gateway processes: one gateway owns the engine worker (engine.worker.port + token), the
other speaks through that same worker (engine.remote), and Kamailio spreads the calls over both.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp
from serve_process import ROOT, ServeProcess, free_port, start_serve

KAMAILIO = shutil.which("kamailio") or ("/usr/sbin/kamailio" if Path("/usr/sbin/kamailio").exists() else None)
pytestmark = [pytest.mark.sipp, pytest.mark.timeout(180),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed"),
              pytest.mark.skipif(KAMAILIO is None, reason="kamailio not installed (apt-get install kamailio)")]

CONFIG = ROOT / "sip_config" / "kamailio" / "kamailio.cfg"


async def _metric(gateway: ServeProcess, name: str, **labels: str) -> float:
    def scrape() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/metrics", timeout=2).read().decode()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    return sample.value
        return 0.0
    return await asyncio.to_thread(scrape)


async def _completed_calls(gateway: ServeProcess) -> float:
    return await _metric(gateway, "gateway_calls_total", outcome="completed")


async def _probes(gateway: ServeProcess) -> float:
    return await _metric(gateway, "gateway_sip_requests_total", method="OPTIONS")


class HeldCall:
    """A caller that answers nothing back and keeps the call up until told: INVITE (X-TTS-After: stay),
    ACK the 200, later BYE. Sent straight to one gateway, to fill it or to keep a drain waiting."""

    def __init__(self, gateway: tuple[str, int]) -> None:
        self.gateway = gateway
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self.call_id = f"held-{self.port}@127.0.0.1"
        self.to_tag = ""

    def _request(self, method: str, cseq: int, body: str = "", extra: str = "") -> bytes:
        to_tag = f";tag={self.to_tag}" if self.to_tag else ""
        return (f"{method} sip:held@{self.gateway[0]}:{self.gateway[1]} SIP/2.0\r\n"
                f"Via: SIP/2.0/UDP 127.0.0.1:{self.port};branch=z9hG4bK-{method}-{self.port}-{cseq};rport\r\n"
                f"From: <sip:held@127.0.0.1>;tag=h{self.port}\r\nTo: <sip:held@127.0.0.1>{to_tag}\r\n"
                f"Call-ID: {self.call_id}\r\nCSeq: {cseq} {method}\r\nContact: <sip:held@127.0.0.1:{self.port}>\r\n"
                f"Max-Forwards: 70\r\n{extra}Content-Length: {len(body)}\r\n\r\n{body}").encode()

    async def _final(self) -> str:
        loop = asyncio.get_running_loop()
        while True:
            data = (await asyncio.wait_for(loop.sock_recv(self.sock, 65535), 10)).decode()
            if data.startswith("SIP/2.0 1"):
                continue
            for line in data.split("\r\n"):
                if line.lower().startswith(("to:", "t:")) and ";tag=" in line:
                    self.to_tag = line.split(";tag=", 1)[1].split(";", 1)[0].strip()
            return data.split("\r\n", 1)[0]

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        sdp = ("v=0\r\no=h 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
               f"m=audio {free_port()} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n")
        await loop.sock_sendto(self.sock, self._request("INVITE", 1, sdp, "X-TTS-Text: held\r\nX-TTS-After: stay\r\n"
                                                        "Content-Type: application/sdp\r\n"), self.gateway)
        status = await self._final()
        assert status.startswith("SIP/2.0 200"), status
        await loop.sock_sendto(self.sock, self._request("ACK", 1), self.gateway)

    async def hang_up(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendto(self.sock, self._request("BYE", 2), self.gateway)
        assert (await self._final()).startswith("SIP/2.0 200")
        self.sock.close()


async def _call_through(proxy: tuple[str, int], workdir: Path, name: str, text: str = "short prompt") -> int:
    """One SIPp call through Kamailio; asserts it was answered, spoken to and ended with BYE."""
    recorder = await rtp_recorder()
    (workdir / name).mkdir()
    rc, errors = await run_sipp(SCENARIOS / "gw_listen.xml", proxy, workdir / name, service="1000", keys={
        "text": text, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"})
    recorder.transport.close()
    assert rc == 0, errors
    assert len(recorder.packets) >= 20, "answered but silent"
    return len(recorder.packets)


async def _worker_metric(port: int, name: str) -> float:
    def scrape() -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
        return sum(sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name == name)
    return await asyncio.to_thread(scrape)


async def test_gateways_of_one_host_share_the_owners_engine_worker_behind_kamailio(tmp_path):
    worker_port, token = free_port(socket.SOCK_STREAM), "host-shared-engine-token"
    common = ("engine.instant.ms_per_char=40", "media.inactivity_timeout_s=0")
    owner = await start_serve(tmp_path, None, *common, "engine.workers=1", f"engine.worker.port={worker_port}",
                              f"engine.worker.token={token}", "media.rtp_port_range=44000-44499", engine="instant",
                              log_name="owner.log")
    other = None
    kamailio = None
    try:
        await owner.wait_healthy()
        # no engine of its own: everything it speaks comes from the owner's worker
        other = await start_serve(tmp_path, None, *common, "engine.workers=0", f"engine.remote.token={token}",
                                  f"engine.remote.urls=[ws://127.0.0.1:{worker_port}/v1/engine/stream]",
                                  "media.rtp_port_range=44500-44999", engine="instant", log_name="other.log")
        await other.wait_healthy()
        assert await _worker_metric(worker_port, "tts_worker_links_open") == 2
        kamailio, port = await _start_kamailio(tmp_path, [owner, other])
        proxy = ("127.0.0.1", port)
        await _until(lambda: _options_answered(proxy), "kamailio to listen")
        opened = await _worker_metric(worker_port, "tts_worker_streams_opened_total")
        for i in range(4):  # texts of their own: each call asks the engine (no prompt cache hit)
            await _call_through(proxy, tmp_path, f"shared{i}", text=f"call number {i}")
        assert [await _completed_calls(g) for g in (owner, other)] == [2, 2]
        assert await _worker_metric(worker_port, "tts_worker_streams_opened_total") == opened + 4
    finally:
        if kamailio is not None and kamailio.returncode is None:
            kamailio.send_signal(signal.SIGTERM)
            await asyncio.wait_for(kamailio.wait(), 10)
        for gateway in (other, owner):
            if gateway is not None:
                await gateway.stop()


async def _start_kamailio(workdir: Path, gateways: list[ServeProcess]) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    listing = workdir / "dispatcher.list"
    listing.write_text("".join(f"1 sip:127.0.0.1:{g.sip_port}\n" for g in gateways))
    log = (workdir / "kamailio.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        KAMAILIO, "-f", str(CONFIG), "-DD", "-E", "-m", "32", "-M", "8", "-Y", str(workdir),
        "-A", f"LISTEN=udp:127.0.0.1:{port}", "-A", f'DISPATCHER_LIST="{listing}"', "-A", "PROBE_INTERVAL=1",
        "-A", "INVITE_TIMEOUT_MS=1000", stdout=log, stderr=log)
    log.close()
    return process, port


async def _until(condition, what: str, timeout_s: float = 15.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_new_calls_avoid_full_killed_and_draining_gateways(tmp_path):
    common = ("engine.instant.ms_per_char=40", "media.inactivity_timeout_s=0", "media.rtp_port_range=44000-44999")
    a = await start_serve(tmp_path, None, *common, engine="instant", log_name="a.log")
    b = await start_serve(tmp_path, None, *common, "shutdown.drain_timeout_s=60", engine="instant", log_name="b.log")
    c = await start_serve(tmp_path, None, *common, "sip.max_calls=1", engine="instant", log_name="c.log")
    gateways = [a, b, c]
    kamailio = None
    try:
        for gateway in gateways:
            await gateway.wait_healthy()
        kamailio, port = await _start_kamailio(tmp_path, gateways)
        proxy = ("127.0.0.1", port)
        await _until(lambda: _options_answered(proxy), "kamailio to listen")

        # all up: round robin reaches every gateway
        for i in range(3):
            await _call_through(proxy, tmp_path, f"up{i}")
        assert [await _completed_calls(g) for g in gateways] == [1, 1, 1]

        # C full (sip.max_calls=1 held by a direct call): it answers 503, the calls go to A and B
        held_c = HeldCall(c.sip_address)
        await held_c.start()
        for i in range(4):
            await _call_through(proxy, tmp_path, f"full{i}")
        assert await _completed_calls(c) == 1
        assert await _completed_calls(a) + await _completed_calls(b) == 6

        # A killed without a word: the calls Kamailio still sends there time out and move on to B
        a.process.kill()
        await a.process.wait()
        before_b = await _completed_calls(b)
        for i in range(3):
            await _call_through(proxy, tmp_path, f"killed{i}")
        assert await _completed_calls(b) == before_b + 3

        # B draining (SIGTERM while a call holds it open): 503, and with C full nobody is left,
        # so the caller is refused by Kamailio: not answered, not silent
        held_b = HeldCall(b.sip_address)
        await held_b.start()
        b.signal(signal.SIGTERM)
        await b.wait_for_event("draining")
        status = await invite_final_response(proxy, {"X-TTS-Text": "anyone?"})
        assert status.startswith("SIP/2.0 503"), status

        # C frees its slot: the next probe marks it up again, and new calls go there, none to draining B
        await held_c.hang_up()
        probes = await _probes(c)
        await _until(lambda: _more_probes(c, probes + 1), "Kamailio to probe C again (200: up)")
        for i in range(2):
            await _call_through(proxy, tmp_path, f"drain{i}")
        assert b.process.returncode is None  # still draining its held call
        await held_b.hang_up()
        assert await b.stop() == 0
    finally:
        if kamailio is not None and kamailio.returncode is None:
            kamailio.send_signal(signal.SIGTERM)
            await asyncio.wait_for(kamailio.wait(), 10)
        for gateway in gateways:
            await gateway.stop()


async def _options_answered(proxy: tuple[str, int]) -> bool:
    from integration_harness import options_status

    try:
        return (await options_status(proxy, timeout=0.5)).startswith("SIP/2.0 200")
    except (TimeoutError, OSError):
        return False


async def _more_probes(gateway: ServeProcess, count: float) -> bool:
    return await _probes(gateway) > count  # one more after the first free one: its 200 has been seen
