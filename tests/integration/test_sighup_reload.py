"""SIGHUP as an operator uses it: routes and the trunk allow-list change without a restart, a broken file
is refused and the running config kept, settings that need a restart say so, and the log file is reopened
after logrotate moved it."""

from __future__ import annotations

import shutil
import signal

import pytest
import yaml

from integration_harness import invite_final_response
from serve_process import start_serve

pytestmark = [pytest.mark.timeout(90)]


def _config(routes: list[dict], log_file: str, trunk: str = "127.0.0.1", max_calls: int = 10) -> str:
    return yaml.safe_dump({
        "sip": {"max_calls": max_calls, "t1_ms": 50},
        "trunks": [{"name": "pbx", "allow": [trunk]}],
        "engine": {"name": "instant"},
        "routes": routes,
        "logging": {"file": log_file},
        "shutdown": {"drain_timeout_s": 1},
    })


async def test_sighup_reloads_routes_and_trunks_refuses_a_broken_file_and_reopens_the_log(tmp_path):
    log_file = tmp_path / "gateway.log"
    config = tmp_path / "gateway.yaml"
    hello = {"match": "1000", "text": "hello"}
    config.write_text(_config([hello], log_file=str(log_file)))
    gateway = await start_serve(tmp_path, config)
    gateway.log_path = log_file  # logging.file: the events go there, not to stderr
    try:
        await gateway.wait_healthy()
        assert (await invite_final_response(gateway.sip_address, {}, user="2000")).startswith("SIP/2.0 404")

        # logrotate moves the file away, then signals; a new route is added at the same time
        shutil.move(log_file, tmp_path / "gateway.log.1")
        config.write_text(_config([hello, {"match": "2000", "text": "new route"}], log_file=str(log_file)))
        gateway.signal(signal.SIGHUP)
        await gateway.wait_for_event("logs_reopened")  # first, so the outcome lands in the new file
        assert (await gateway.wait_for_event("config_reloaded"))["changed"] == ["routes"]
        assert (await invite_final_response(gateway.sip_address, {}, user="2000")).startswith("SIP/2.0 200")

        config.write_text(_config([hello, {"match": "2000", "text": "x", "colour": "red"}], log_file=str(log_file)))
        gateway.signal(signal.SIGHUP)
        refused = await gateway.wait_for_event("config_reload_refused")
        assert refused["level"] == "error" and refused["errors"] == ["routes[1].colour: unknown field"]
        assert (await invite_final_response(gateway.sip_address, {}, user="2000")).startswith("SIP/2.0 200")

        config.write_text(_config([hello], trunk="192.0.2.10", max_calls=20, log_file=str(log_file)))
        gateway.signal(signal.SIGHUP)
        assert (await gateway.wait_for_event("config_reload_needs_restart"))["sections"] == ["sip"]
        assert (await gateway.wait_for_event("config_reloaded"))["changed"] == ["trunks", "routes"]
        assert (await invite_final_response(gateway.sip_address, {}, user="1000")).startswith("SIP/2.0 403")
        assert (await gateway.healthz())[1]["status"] == "ok"

        assert await gateway.stop() == 0
        rotated = (tmp_path / "gateway.log.1").read_text()
        assert "gateway_started" in rotated and "logs_reopened" not in rotated
        assert gateway.log_events()[-1]["event"] == "gateway_stopped"
    finally:
        await gateway.stop()


async def test_a_reload_naming_a_voice_the_engine_lacks_is_refused(tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"engine": {"name": "instant"}, "routes": [{"match": "1000", "text": "hi"}]}))
    gateway = await start_serve(tmp_path, config)
    try:
        await gateway.wait_healthy()
        config.write_text(yaml.safe_dump({"engine": {"name": "instant"},
                                          "routes": [{"match": "1000", "text": "hi", "voice": "klingon"}]}))
        gateway.signal(signal.SIGHUP)
        refused = await gateway.wait_for_event("config_reload_refused")
        assert refused["errors"][0].startswith("routes[0].voice: 'klingon' is not a voice of engine instant")
        assert await gateway.stop() == 0
    finally:
        await gateway.stop()


async def test_a_reload_of_an_emptied_file_is_refused_and_calls_keep_their_routes(tmp_path):
    """An emptied file (a deploy that lost its content) was adopted: no routes, every routed call 404 while
    /healthz said 200. It is refused with one error naming the file; the running routes stay."""
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"engine": {"name": "instant"}, "routes": [{"match": "1000", "text": "hi"}],
                                      "shutdown": {"drain_timeout_s": 0.5}}))
    gateway = await start_serve(tmp_path, config)
    try:
        await gateway.wait_healthy()
        for emptied in ("", "# routes moved elsewhere\n"):
            config.write_text(emptied)
            gateway.signal(signal.SIGHUP)
            refused = await gateway.wait_for_event("config_reload_refused")
            assert refused["errors"] == [f"{config}: the file is empty; expected sections such as sip, trunks, "
                                         "routes (start without --config for the built-in loopback config)"]
            assert (await invite_final_response(gateway.sip_address, {}, user="1000")).startswith("SIP/2.0 200")
        assert (await gateway.healthz())[0] == 200
        assert await gateway.stop() == 0
    finally:
        await gateway.stop()
