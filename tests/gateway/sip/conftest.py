"""Fixtures for the SIP stack tests: a real SipServer on 127.0.0.1 (port 0, small T1) with a test
call layer, a raw UDP peer, and SIPp (skipped where the binary is missing)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from gateway.sip.uas import SipServer, SipSettings
from tests.gateway.sip.peers import T1, Phone, Sipp, UdpPeer


@pytest.fixture
async def make_server() -> AsyncIterator[Callable[..., object]]:
    servers: list[SipServer] = []

    async def make(policy: str = "accept", **overrides: object) -> tuple[SipServer, Phone]:
        phone = Phone(policy)
        settings = SipSettings(**{"listen_host": "127.0.0.1", "listen_port": 0, "t1": T1, "t2": 0.4,
                                  "t4": 0.25, **overrides})
        server = SipServer(settings, phone.on_invite)
        await server.start()
        servers.append(server)
        return server, phone

    yield make
    for server in servers:
        await server.stop()


@pytest.fixture
async def udp_peer() -> AsyncIterator[UdpPeer]:
    transport, peer = await asyncio.get_running_loop().create_datagram_endpoint(
        UdpPeer, local_addr=("127.0.0.1", 0))
    peer.transport = transport
    yield peer
    transport.close()


@pytest.fixture
def sipp(tmp_path: Path) -> Sipp:
    if shutil.which("sipp") is None:
        pytest.skip("sipp binary not installed (Debian package sip-tester)")
    return Sipp(tmp_path)
