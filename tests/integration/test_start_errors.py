"""Operator mistakes at start, as `serve` meets them: one line on stderr naming the key and exit 2 (the
systemd unit's RestartPreventExitStatus=2: no restart loop over a mistake only the operator can fix)."""

from __future__ import annotations

import socket

import pytest

from integration_harness import invite_final_response
from serve_process import free_port, start_serve

pytestmark = [pytest.mark.timeout(90)]


def _not_json(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip() and not line.startswith("{")]


async def test_a_sip_port_in_use_is_one_line_naming_sip_listen_and_exit_2(tmp_path):
    port = free_port()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", port))
        gateway = await start_serve(tmp_path, None, f"sip.listen=127.0.0.1:{port}", engine="instant")
        assert await gateway.process.wait() == 2
    log = gateway.tail(20000)
    assert "Traceback" not in log
    assert _not_json(log) == [f"cosyvoice-gateway: config error: sip.listen: cannot listen on 127.0.0.1:{port} "
                              "(udp): Address already in use"]
    # the port is free again: the same command serves, and a call is answered
    gateway = await start_serve(tmp_path, None, f"sip.listen=127.0.0.1:{port}", "shutdown.drain_timeout_s=0.5",
                                engine="instant", log_name="second.log")
    try:
        await gateway.wait_healthy()
        assert (await invite_final_response(("127.0.0.1", port), {"X-TTS-Text": "hi"})).startswith("SIP/2.0 200")
    finally:
        assert await gateway.stop() == 0


async def test_an_empty_config_file_is_refused_at_start(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text("# emptied by a failed deploy\n")
    gateway = await start_serve(tmp_path, config, engine="instant")
    assert await gateway.process.wait() == 2
    assert _not_json(gateway.tail()) == [f"cosyvoice-gateway: config error: {config}: the file is empty; expected "
                                         "sections such as sip, trunks, routes (start without --config for the "
                                         "built-in loopback config)"]


async def test_a_prompt_cache_directory_that_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    blocker = tmp_path / "cache"
    blocker.write_text("a file where the directory should be\n")  # root ignores permissions; this it cannot
    gateway = await start_serve(tmp_path, None, f"prompt_cache.directory={blocker / 'prompts'}", engine="instant")
    assert await gateway.process.wait() == 2
    assert _not_json(gateway.tail()) == [f"cosyvoice-gateway: config error: prompt_cache.directory: cannot use "
                                         f"{blocker / 'prompts'} (Not a directory)"]
