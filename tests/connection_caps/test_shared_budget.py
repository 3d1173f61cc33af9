"""One descriptor budget shared by the gateway's HTTP port and SIP TCP (issue 31, item 3), over real sockets;
and the pure counts behind it."""

from __future__ import annotations

import asyncio
import os
import resource
import socket

from connection_caps.budget import ConnectionCaps, DescriptorBudget
from gateway import metrics
from gateway.http_api import start_http, stop_http
from gateway.sip.transport import SipTransport, StreamLimits
from tests.peer_sockets import closed_by_peer


async def test_sip_tcp_and_http_draw_on_one_descriptor_budget():
    budget = DescriptorBudget(5)
    sip = SipTransport("127.0.0.1", 0, ("tcp",), lambda data, peer: None, limits=StreamLimits(budget=budget))
    await sip.start()
    http = await start_http(lambda: {"status": "ok"}, "127.0.0.1", 0, budget=budget)
    refused_before = metrics.http_connections_refused_total.labels("descriptors")._value.get()
    held = []
    try:
        held += [socket.create_connection(sip.tcp_address) for _ in range(3)]
        await asyncio.sleep(0.1)
        held += [socket.create_connection(("127.0.0.1", http.port)) for _ in range(3)]
        await asyncio.sleep(0.2)
        assert budget.in_use == 5
        assert [closed_by_peer(sock, 0.05) for sock in held] == [False] * 5 + [True]  # the 6th: none left
        assert metrics.http_connections_refused_total.labels("descriptors")._value.get() == refused_before + 1
        held.pop().close()
        held.pop(0).close()  # a SIP connection gone gives its descriptor back to HTTP
        await asyncio.sleep(0.1)
        reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await reader.read()).startswith(b"HTTP/1.1 200")
        writer.close()
    finally:
        for sock in held:
            sock.close()
        await stop_http(http)
        await sip.stop()
    await asyncio.sleep(0.1)
    assert budget.in_use == 0


def test_the_budget_keeps_the_open_and_reserved_descriptors_back():
    budget = DescriptorBudget.from_rlimit(reserved=200)
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert budget.available == soft - len(os.listdir("/proc/self/fd")) - 200 - 160


def test_caps_count_total_per_source_and_the_probation_reserve():
    caps = ConnectionCaps(max_connections=3, max_connections_per_source=2, reserve=1)
    assert [caps.admit("a"), caps.admit("a"), caps.admit("a")] == [None, None, "probation"]
    assert caps.admit("a") == "max_connections_per_source"  # the reserve is taken
    assert caps.admit("b") is None
    assert caps.admit("c") == "max_connections"
    caps.confirm()  # the one on probation proved trusted: the reserve is free again
    assert caps.admit("c") == "probation"
    caps.release("c", probation=True)
    caps.release("a", probation=False)
    assert caps.admit("c") == "probation"  # the trusted one counts in the total: a, a, b still hold it
    caps.release("c", probation=True)
    caps.release("b", probation=False)
    assert caps.admit("c") is None
