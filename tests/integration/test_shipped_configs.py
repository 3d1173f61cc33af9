"""Every config in sip_config/ starts as shipped (an example that cannot start makes systemd's restart loop
spin), answers a call, keeps that call going through SIGHUP, and exits 0 on SIGTERM.

The examples are written for a server: they listen on 0.0.0.0:5060, admit only their example trunks
(192.0.2.x) and, for cosyvoice2, load a real model on a GPU. The test overrides only what a loopback run
needs, with the same `--set` an operator has: the listen ports, advertised_host, a loopback trunk, a prompt cache
directory the test may write (the examples name the systemd unit's /var/cache/cosyvoice-gateway), and for
cosyvoice2 the tiny golden model on CPU (its one voice standing in for the example's voice aliases).
Everything else (routes, prompts, voices, engine voice table, timers) is the shipped file's.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from integration_harness import SCENARIOS, rtp_recorder, run_sipp
from serve_process import ROOT, start_serve

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

CONFIGS = sorted((ROOT / "sip_config").glob("*.yaml"))
LOOPBACK = ("sip.advertised_host=127.0.0.1", "trunks=[{name: loopback, allow: [127.0.0.1]}]",
            "media.rtp_port_range=43000-43999", "shutdown.drain_timeout_s=5")


def _engine_settings(config: Path, request: pytest.FixtureRequest) -> tuple[str, ...]:
    if yaml.safe_load(config.read_text())["engine"]["name"] != "cosyvoice2":
        return ()
    pytest.importorskip("torch")
    tiny = request.getfixturevalue("tiny_model_dir")
    speaker = "golden_speaker"
    return (f"engine.cosyvoice2.model_dir={tiny}", "engine.cosyvoice2.device=cpu", "engine.cosyvoice2.dtype=fp32",
            f"engine.cosyvoice2.default_voice={speaker}", "engine.cosyvoice2.max_batch=2",
            "engine.cosyvoice2.compile_flow=false", "engine.cosyvoice2.compile_hift=false",
            "engine.cosyvoice2.slot_attention=false", f"voices.english={speaker}", f"voices.mandarin={speaker}")


def test_the_examples_are_all_here():
    assert {path.name for path in CONFIGS} >= {"gateway.yaml", "gateway-cosyvoice2.yaml"}


@pytest.mark.parametrize("config", CONFIGS, ids=[path.name for path in CONFIGS])
async def test_shipped_config_serves_a_call_through_sighup_and_stops_cleanly(config, request, tmp_path):
    engine_settings = _engine_settings(config, request)
    # the tiny random-weight model on CPU is slower than real time: a short text keeps its call under the
    # scenario's 30 s wait for BYE
    text = "Hello from the neural engine." if engine_settings else \
        "This call keeps talking while the gateway reloads its configuration."
    gateway = await start_serve(tmp_path, config, *LOOPBACK, f"prompt_cache.directory={tmp_path / 'prompts'}",
                                *engine_settings)
    try:
        health = await gateway.wait_healthy(timeout_s=180, status="ok")  # every worker ready, not "degraded"
        assert health["workers_ready"] == health["workers_total"] >= 1

        recorder = await rtp_recorder()
        call = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip_address, tmp_path, keys={
            "text": text, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"}, timeout_s=120))
        first = asyncio.create_task(recorder.wait_for_packets(1, timeout_s=120))
        await asyncio.wait([first, call], return_when=asyncio.FIRST_COMPLETED)
        first.cancel()
        assert recorder.packets, f"no RTP before the call ended: {call.result()}"
        gateway.signal(signal.SIGHUP)  # mid-prompt
        reloaded = await gateway.wait_for_event("config_reloaded")
        assert reloaded["changed"] == []
        rc, errors = await call
        recorder.transport.close()
        assert rc == 0, errors  # the prompt ran to its end and the gateway hung up with BYE
        packets = recorder.packets
        assert all((b.seq - a.seq) % 65536 == 1 for a, b in zip(packets, packets[1:])), "RTP was interrupted"
        assert gateway.process.returncode is None
        assert (await gateway.healthz())[0] == 200

        assert await gateway.stop() == 0, gateway.tail()
        events = [event["event"] for event in gateway.log_events()]
        assert "gateway_stopped" in events, gateway.tail()
        assert events[-1] in ("gateway_stopped", "engine_workers_stopped"), gateway.tail()  # nothing after
    finally:
        await gateway.stop()
