"""What an operator relies on around the calls: a broken synthesis ends only its own call, draining
refuses new calls while current prompts finish, and SIGTERM stops the service cleanly."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import urllib.request

import numpy as np
import pytest

from engines.base import SynthesisFailed, SynthesisRequest
from engines.channel import ChunkChannel
from engines.instant import InstantEngine
from gateway import metrics
from integration_harness import SCENARIOS, invite_final_response, rtp_recorder, run_sipp, start_gateway

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(90),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]


class BreaksOnCueEngine(InstantEngine):
    """The instant engine, except that a text containing 'break' fails after its first chunk, the way a
    model that runs out of memory mid-utterance would."""

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        if "break" not in request.text:
            return super().open_stream(request)
        self.validate(request)
        channel = ChunkChannel()
        channel.put(np.full(4800, 0.1, dtype=np.float32))  # 200 ms of audio, then the failure
        channel.fail(SynthesisFailed("model fell over"))
        return channel


def _outcome(name: str) -> float:
    return metrics.registry.get_sample_value("gateway_calls_total", {"outcome": name}) or 0.0


async def test_synthesis_failure_ends_only_that_call(tmp_path):
    engine = BreaksOnCueEngine(ms_per_char=100)
    gateway = await start_gateway("instant", engine_obj=engine)
    try:
        failed0, done0 = _outcome("failed"), _outcome("completed")
        failures0 = metrics.registry.get_sample_value("gateway_synthesis_failures_total") or 0.0
        healthy_rtp, broken_rtp = await rtp_recorder(), await rtp_recorder()
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        healthy = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address,
                                               tmp_path / "a", keys={
            "text": "a healthy prompt of a couple of seconds", "rtp_rx": str(healthy_rtp.port),
            "codec_pt": "0", "codec_name": "PCMU"}))
        broken = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address,
                                              tmp_path / "b", keys={
            "text": "this one will break", "rtp_rx": str(broken_rtp.port), "codec_pt": "0", "codec_name": "PCMU"}))
        (rc_ok, err_ok), (rc_broken, err_broken) = await asyncio.gather(healthy, broken)
        assert rc_ok == 0, err_ok
        assert rc_broken == 0, err_broken  # the broken call still ended with a proper BYE
        assert _outcome("failed") == failed0 + 1
        assert _outcome("completed") == done0 + 1
        assert (metrics.registry.get_sample_value("gateway_synthesis_failures_total") or 0) == failures0 + 1
        assert len(healthy_rtp.packets) > 100  # ~3.9 s of prompt, all of it
    finally:
        await gateway.stop()


async def test_draining_refuses_new_calls_while_the_current_prompt_finishes(tmp_path):
    gateway = await start_gateway("instant", engine_settings={"ms_per_char": 60})
    try:
        recorder = await rtp_recorder()
        call = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, tmp_path, keys={
            "text": "x" * 40, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"}))
        await recorder.wait_for_packets(1)  # answered and speaking
        drain = asyncio.create_task(gateway.drain(timeout_s=20))
        await asyncio.sleep(0)  # one turn of the loop: drain() stops admitting before its first await
        status = await invite_final_response(gateway.sip.udp_address, {"X-TTS-Text": "too late"})
        assert status.startswith("SIP/2.0 503")
        assert gateway.status()["draining"] is True
        rc, errors = await call
        await drain
        assert rc == 0, errors
        assert len(recorder.packets) >= 100  # the 2.4 s prompt in progress was played to its end
    finally:
        await gateway.stop()


def _free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_sigterm_stops_the_service_cleanly():
    sip_port, http_port = _free_port(socket.SOCK_DGRAM), _free_port(socket.SOCK_STREAM)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "serve", "--sip-listen", f"127.0.0.1:{sip_port}",
        "--http-listen", f"127.0.0.1:{http_port}", "--engine", "instant",
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        for _ in range(100):
            try:
                body = await asyncio.to_thread(lambda: urllib.request.urlopen(
                    f"http://127.0.0.1:{http_port}/healthz", timeout=1).read())
                break
            except OSError:
                await asyncio.sleep(0.1)
        else:
            pytest.fail("gateway did not start")
        assert b'"ok"' in body
        process.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(process.communicate(), 20)
        assert process.returncode == 0, stderr.decode()[-2000:]
        assert b"gateway_stopped" in stderr
    finally:
        if process.returncode is None:
            process.kill()


async def test_drain_timeout_hangs_up_remaining_calls_with_bye(tmp_path):
    gateway = await start_gateway("instant", engine_settings={"ms_per_char": 60})
    try:
        recorder = await rtp_recorder()
        call = asyncio.create_task(run_sipp(SCENARIOS / "gw_listen.xml", gateway.sip.udp_address, tmp_path, keys={
            "text": "y" * 200, "rtp_rx": str(recorder.port), "codec_pt": "0", "codec_name": "PCMU"}))
        await recorder.wait_for_packets(1)  # answered and speaking
        await gateway.drain(timeout_s=0.5)  # the 12 s prompt cannot finish in time
        rc, errors = await call
        assert rc == 0, errors  # the caller got a BYE (gw_listen waits for it and answers 200)
        assert gateway.status()["calls_active"] == 0
        assert len(recorder.packets) < 100  # cut short, not played to the end
    finally:
        await gateway.stop()
