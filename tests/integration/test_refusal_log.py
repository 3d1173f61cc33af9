"""A source outside the trunks, as a newcomer's first call from the gateway's own host meets it (issue #33
item 2): `serve` answers 403 and names the source and the reason in its log, once per source and minute
however hard the source keeps trying (a burst of INVITEs and a TCP connection)."""

from __future__ import annotations

import asyncio
import socket
import urllib.request

import pytest

from integration_harness import invite_final_response
from serve_process import ServeProcess, start_serve

pytestmark = [pytest.mark.timeout(60)]


def _invite(port: int, n: int, source_port: int) -> bytes:
    return (f"INVITE sip:1000@127.0.0.1:{port} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP 127.0.0.2:{source_port};branch=z9hG4bK-burst-{n}\r\n"
            f"From: <sip:x@127.0.0.2>;tag=b{n}\r\nTo: <sip:1000@127.0.0.1>\r\nCall-ID: burst-{n}@127.0.0.2\r\n"
            "CSeq: 1 INVITE\r\nMax-Forwards: 70\r\nContent-Length: 0\r\n\r\n").encode()


async def _dropped_not_allowed(gateway: ServeProcess) -> float:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{gateway.http_port}/metrics", timeout=5) as response:
            return response.read().decode()
    text = await asyncio.to_thread(get)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('gateway_sip_dropped_total{reason="not_allowed"}'))


async def test_a_refused_source_gets_403_and_one_log_line_naming_it_and_why_even_under_a_burst(tmp_path):
    gateway = await start_serve(tmp_path, None, "trunks=[{name: pbx, allow: [192.0.2.10]}]",
                                "sip.transports=[udp,tcp]", engine="instant")
    try:
        await gateway.wait_healthy()
        assert await invite_final_response(gateway.sip_address, {"X-TTS-Text": "hi"}) == "SIP/2.0 403 Forbidden"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as burst:  # another source: 127.0.0.2
            burst.bind(("127.0.0.2", 0))
            for n in range(200):
                burst.sendto(_invite(gateway.sip_port, n, burst.getsockname()[1]), gateway.sip_address)
        for source in ("127.0.0.1", "127.0.0.3"):  # TCP: closed at accept, named like a request
            with socket.create_connection(gateway.sip_address, source_address=(source, 0)):
                pass
        seen, last = await _dropped_not_allowed(gateway), -1.0
        while seen != last:  # until the gateway has handled what reached it (the kernel may drop some of a burst)
            await asyncio.sleep(0.3)
            seen, last = await _dropped_not_allowed(gateway), seen
        assert seen > 50  # the burst was refused, one request after another
        refused = [e for e in gateway.log_events() if e.get("event") == "sip_source_refused"]
        assert sorted((e["source"], e["reason"], e["what"]) for e in refused) == [
            ("127.0.0.1", "not_in_trunks", "INVITE"), ("127.0.0.2", "not_in_trunks", "INVITE"),
            ("127.0.0.3", "not_in_trunks", "TCP connection")]
        assert all(e["fix"].startswith("add the address to trunks[].allow") for e in refused)
    finally:
        assert await gateway.stop() == 0
