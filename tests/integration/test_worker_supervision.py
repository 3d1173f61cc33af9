"""Supervision that never gives up, tried as an operator would: `cosyvoice-gateway serve` (a subprocess) with two
supervised instant workers, real SIPp callers and RTP sockets on loopback, and the faults done to the real worker
processes (SIGKILL, SIGSTOP, a port another process holds, exit code 2 from a signal handler that a
`sitecustomize` on the PYTHONPATH installs: tests/integration/worker_faults/).

A worker killed again and again is restarted every time and only its own calls end; a stopped (hung) worker is
seen, its calls end, and it is killed and restarted while the other serves; a worker that cannot start is retried
while the other serves (degraded, 200, each worker's state in /healthz), and with none ready the gateway waits,
503, retrying; exit 2 is "settings refused", ending the
start with one line, only before a worker's first ready; a worker's children and a vanished working directory do
not follow it into its next start."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import time
from pathlib import Path

import pytest
from integration_harness import invite_final_response
from supervised_serve import REPO, free_tcp_port, listening_call, speech_level, start_serve, stop_serve

pytestmark = [pytest.mark.sipp, pytest.mark.timeout(240),
              pytest.mark.skipif(shutil.which("sipp") is None, reason="sipp (sip-tester) not installed")]

FAULTS = Path(__file__).parent / "worker_faults"
# One character a second: a call's length is its text's length in seconds.
SLOW_INSTANT = {"realtime": True, "ms_per_char": 1000, "max_duration_s": 300}
LONG = "This caller stays on the line for the whole test while the other worker is broken again and again."


def _alive(pid: int) -> bool:
    """A process that runs (a zombie waiting to be reaped is gone for the caller's purposes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def _heard(serve, tmp_path: Path, text: str, name: str) -> None:
    """A whole call: answered, speech arrives, the gateway's BYE at the end of the prompt."""
    call, recorder = await listening_call(serve, tmp_path, text, name)
    rc, errors, _ = await asyncio.wait_for(call, 90)
    recorder.transport.close()
    assert rc == 0, errors
    assert len(recorder.packets) > 25 and speech_level(recorder) > 300


async def test_a_worker_killed_five_times_under_calls_is_back_every_time_and_only_its_calls_end(tmp_path):
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 2, "worker": {"slots": 1},
                                         "instant": SLOW_INSTANT}, extra={"shutdown": {"drain_timeout_s": 1}})
    try:
        await serve.until_healthy(slots_free=2)
        survivor_call, survivor = await listening_call(serve, tmp_path, LONG, "survivor", timeout_s=300)
        await survivor.wait_for_packets(10, timeout_s=20)
        body = await serve.until_healthy(slots_free=1)
        victim = next(name for name, worker in body["workers"].items() if worker["slots_free"] == 1)
        assert {worker["speed"] for worker in body["workers"].values()} == {"full"}  # instant: nothing to compile

        for kill in range(1, 6):
            # A call on the victim (its only free slot), heard: after the first kill, this is the call that
            # proves the restarted worker speaks.
            call, recorder = await listening_call(serve, tmp_path, "Killed in the middle of this call.", f"v{kill}")
            await recorder.wait_for_packets(25, timeout_s=20)
            assert speech_level(recorder) > 300
            status, body = await serve.healthz()
            assert body["workers"][victim]["slots_free"] == 0, body
            pid = body["workers"][victim]["pid"]
            os.kill(pid, signal.SIGKILL)
            killed_at, survivor_packets = time.monotonic(), len(survivor.packets)

            rc, errors, ended_at = await asyncio.wait_for(call, 10)  # its call got the gateway's BYE
            recorder.transport.close()
            assert rc == 0, errors
            assert ended_at - killed_at < 3, f"BYE {ended_at - killed_at:.2f} s after the kill"
            if kill >= 3:  # down, one of two, and why (the backoff is 2 s and more from the 3rd kill: caught waiting)
                body = await serve.until(lambda _status, body: body["workers"][victim].get("why", "").startswith(
                    "restarting after SIGKILL"), timeout=2)
                assert (body["workers_ready"], body["workers_total"]) == (1, 2), body
            await survivor.wait_for_packets(survivor_packets + 50, timeout_s=5)  # the other call still speaks
            assert not survivor_call.done()

            body = await serve.until_workers_ready(2, timeout=60)
            assert body["workers"][victim]["pid"] not in (None, pid)
            assert await serve.metric("gateway_engine_worker_restarts_total") == kill
            assert await serve.metric("gateway_engine_worker_streams_lost_total") == kill  # only the victim's

        await _heard(serve, tmp_path, "Back again.", "after")  # lands on the victim: the survivor's slot is taken
        assert not survivor_call.done()
        exits = serve.log_events("engine_worker_exited")
        assert [(e["worker"], e["signal"], e["rc"]) for e in exits] == [(victim, "SIGKILL", None)] * 5
        assert [e["restart_in_s"] for e in exits] == [0.5, 1.0, 2.0, 4.0, 8.0]  # the capped backoff, doubling

        serve.process.send_signal(signal.SIGTERM)  # the survivor's prompt is cut at the drain's end, with a BYE
        rc, errors, _ = await asyncio.wait_for(survivor_call, 60)
        survivor.transport.close()
        assert rc == 0, errors
        assert await asyncio.wait_for(serve.process.wait(), 30) == 0
    finally:
        await stop_serve(serve)


async def test_a_worker_stopped_for_ten_seconds_is_seen_its_calls_end_and_it_is_killed_and_restarted(tmp_path):
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 2, "worker": {"slots": 2},
                                         "instant": SLOW_INSTANT}, extra={"shutdown": {"drain_timeout_s": 1}})
    try:
        await serve.until_healthy(slots_free=4)
        calls = [await listening_call(serve, tmp_path, LONG, f"call{i}", timeout_s=300) for i in range(2)]
        await asyncio.gather(*(recorder.wait_for_packets(10, timeout_s=20) for _, recorder in calls))
        body = await serve.until_healthy(slots_free=2)
        assert [worker["slots_free"] for worker in body["workers"].values()] == [1, 1]  # one call on each
        frozen = "instant-0"
        pid = body["workers"][frozen]["pid"]
        os.kill(pid, signal.SIGSTOP)
        stopped_at = time.monotonic()

        # Seen within engine.worker.dead_after_ms (1 s): the frozen worker's call gets its BYE, the other speaks on.
        done, _ = await asyncio.wait([task for task, _ in calls], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert len(done) == 1, "exactly the frozen worker's call ends"
        rc, errors, ended_at = done.pop().result()
        assert rc == 0, errors
        assert ended_at - stopped_at < 3, f"BYE {ended_at - stopped_at:.2f} s after SIGSTOP"
        survivor_task, survivor = next((task, recorder) for task, recorder in calls if not task.done())
        await survivor.wait_for_packets(len(survivor.packets) + 50, timeout_s=5)

        # Meanwhile the gateway is degraded, still 200, and says which worker is not serving and why; a new call is
        # served by the other worker.
        status, body = await serve.healthz()
        assert status == 200 and body["status"] == "degraded", body
        assert (body["workers_ready"], body["workers_total"]) == (1, 2)
        assert body["workers_summary"] == "1 of 2 engine workers ready"
        assert body["workers"][frozen]["why"].startswith("listening, but its link has not served"), body
        meanwhile, recorder = await listening_call(serve, tmp_path, "Meanwhile.", "meanwhile")
        await recorder.wait_for_packets(25, timeout_s=20)
        assert speech_level(recorder) > 300

        # Not serving for 5 s: killed (SIGKILL works on a stopped process) and restarted, before anyone sends SIGCONT.
        body = await serve.until_workers_ready(2, timeout=30)
        assert body["workers"][frozen]["pid"] != pid and not _alive(pid)
        assert await serve.metric('gateway_engine_worker_kills_total{reason="hung",worker="instant-0"}') == 1
        killed, = serve.log_events("engine_worker_exited")
        assert (killed["worker"], killed["signal"], killed["killed_for"]) == (frozen, "SIGKILL", "hung")
        rc, errors, _ = await asyncio.wait_for(meanwhile, 60)
        recorder.transport.close()
        assert rc == 0, errors
        await asyncio.sleep(max(stopped_at + 10 - time.monotonic(), 0))
        if _alive(pid):
            os.kill(pid, signal.SIGCONT)
        await _heard(serve, tmp_path, "Back.", "back")
        assert not survivor_task.done()

        serve.process.send_signal(signal.SIGTERM)
        rc, errors, _ = await asyncio.wait_for(survivor_task, 60)
        assert rc == 0, errors
        for _, recorder in calls:
            recorder.transport.close()
    finally:
        await stop_serve(serve)


async def test_a_worker_that_cannot_start_is_retried_while_the_other_serves(tmp_path):
    """Worker 0's fixed port is held by another process: it exits 1 at every start and is started again, while the
    gateway serves on worker 1 (degraded, not a failed start); once the port is free it is ready."""
    port = free_tcp_port()
    while True:  # worker 1 takes port + 1: it must be free too
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + 1))
            break
        except OSError:
            port = free_tcp_port()
    holder = socket.socket()
    holder.bind(("127.0.0.1", port))
    holder.listen()
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 2, "worker": {"port": port}})
    try:
        body = await serve.until_healthy(timeout=60)
        while len(serve.log_events("engine_worker_exited")) < 2:  # retried, not given up on
            assert serve.process.returncode is None
            await asyncio.sleep(0.1)  # waiting for the supervisor's second try, as an operator reading the log would
        status, body = await serve.healthz()
        assert status == 200 and body["status"] == "degraded", body
        assert (body["workers_ready"], body["workers_total"]) == (1, 2)
        why = body["workers"]["instant-0"]["why"]
        assert "exit code 1" in why and why.startswith(("restarting after", "starting for")), why
        await _heard(serve, tmp_path, "Served by the other worker.", "degraded")
        assert {e["rc"] for e in serve.log_events("engine_worker_exited")} == {1}

        holder.close()
        body = await serve.until_workers_ready(2, timeout=60)
        assert body["status"] == "ok"
    finally:
        holder.close()
        await stop_serve(serve)


async def test_with_no_worker_ever_ready_the_gateway_waits_refusing_calls_and_keeps_trying(tmp_path):
    """No deadline on the gateway's start: a worker that cannot be ready within engine.worker.start_timeout_s
    (0.1 s: no Python starts that fast) is killed and started again, while SIP and /healthz say 503 and why."""
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 1, "worker": {"start_timeout_s": 0.1}})
    try:
        body = await serve.until(lambda _status, body: body["workers"]["instant-0"]["why"].startswith(
            "restarting after SIGKILL (start timeout)"), timeout=60)
        status, body = await serve.healthz()
        assert status == 503 and body["status"] == "engine_warming" and body["workers_ready"] == 0, body
        assert (await invite_final_response(serve.sip, {"X-TTS-Text": "hello"})).startswith("SIP/2.0 503")
        while await serve.metric("gateway_engine_worker_kills_total") < 2:  # and again: never given up
            await asyncio.sleep(0.1)  # waiting for the supervisor's next try, as an operator's scraper would
        assert serve.process.returncode is None
    finally:
        await stop_serve(serve)
    assert serve.process.returncode == 0  # SIGTERM while still waiting: a clean stop


async def test_exit_2_before_the_first_ready_stops_the_start_with_one_line_and_exit_2(tmp_path):
    # The speech API's block is checked by the worker, not the gateway: the worker refuses it, exit 2.
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 2, "worker": {"port": free_tcp_port()}},
                              extra={"tts_api": {"max_text_chars": 0}})
    assert await asyncio.wait_for(serve.process.wait(), 60) == 2
    last = serve.log_path.read_text().strip().splitlines()[-1]
    assert last.startswith("cosyvoice-gateway: config error: engine.instant: engine worker instant-"), last
    assert "refused its settings: config error: tts_api.max_text_chars" in last, last
    assert not serve.workers()


async def test_exit_2_after_a_ready_is_an_exit_like_any_other_and_the_worker_is_restarted(tmp_path):
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 1},
                              env={"PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}"})
    try:
        await serve.until_healthy(timeout=60)
        worker, = serve.workers()
        os.kill(worker, signal.SIGUSR1)  # the fault hook: exit code 2, at once
        await serve.until(lambda _status, body: body["workers"]["instant-0"]["pid"] not in (None, worker)
                          and body["workers_ready"] == 1, timeout=30)
        exited, = serve.log_events("engine_worker_exited")
        assert (exited["rc"], exited["signal"]) == (2, None)
        assert not serve.log_events("engine_worker_refused")
        assert await serve.metric("gateway_engine_worker_restarts_total") == 1
        await _heard(serve, tmp_path, "Restarted after exit 2.", "after")
    finally:
        await stop_serve(serve)
    assert serve.process.returncode == 0


async def test_a_dead_workers_children_and_a_vanished_working_directory_do_not_follow_it_into_its_restart(tmp_path):
    """A child that shares the worker's pipes and outlives it (as torch inductor's compile workers do) is killed
    with it, and its exit is seen at once; a restart enters the gateway's directory anew by name: a directory
    replaced under the gateway is the new one, a deleted one is `/` (torch's MKL exits 2 at import in a working
    directory that is gone, "Cannot load .../libtorch_cpu.so")."""
    pidfile, run_dir = tmp_path / "children", tmp_path / "run"
    run_dir.mkdir()
    serve = await start_serve(tmp_path, {"name": "instant", "workers": 1}, cwd=run_dir,
                              env={"PYTHONPATH": f"{FAULTS}{os.pathsep}{REPO}", "TEST_WORKER_CHILD_PIDFILE": str(pidfile)})

    async def kill_and_restart(worker: int) -> int:
        os.kill(worker, signal.SIGKILL)
        await serve.until(lambda _status, body: body["workers"]["instant-0"]["pid"] not in (None, worker)
                          and body["workers_ready"] == 1, timeout=30)
        new, = serve.workers()
        return new

    try:
        await serve.until_healthy(timeout=60)
        first, = serve.workers()
        child = int(pidfile.read_text().split()[0])
        assert _alive(child) and os.getpgid(child) == first  # in the worker's own process group

        shutil.rmtree(run_dir)
        run_dir.mkdir()  # a redeploy replaced the directory the gateway was started in
        second = await kill_and_restart(first)
        assert not _alive(child)
        assert serve.log_events("engine_worker_children_killed")
        assert os.readlink(f"/proc/{second}/cwd") == str(run_dir)  # the new directory, not "... (deleted)"

        shutil.rmtree(run_dir)  # and now it is gone for good
        third = await kill_and_restart(second)
        assert os.readlink(f"/proc/{third}/cwd") == "/"
        assert serve.log_events("engine_worker_cwd_gone")
        await _heard(serve, tmp_path, "Still here.", "after")
    finally:
        await stop_serve(serve)
    assert not any(_alive(int(pid)) for pid in pidfile.read_text().split())  # no child outlived the gateway


async def test_a_torch_worker_restarted_after_the_gateways_directory_vanished_is_ready_again(tmp_path, tiny_model_dir):
    """The GPU host's failure, on a CPU: a cosyvoice2 worker killed after the directory the gateway was started in
    was deleted came back and died at once, "Intel oneMKL FATAL ERROR: Cannot load .../libtorch_cpu.so", exit 2
    (MKL calls getcwd() when torch is imported), and that exit 2 was taken for settings refused, for good."""
    pytest.importorskip("torch")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    serve = await start_serve(tmp_path, {"name": "cosyvoice2", "workers": 1, "cosyvoice2": {
        "model_dir": str(tiny_model_dir), "device": "cpu", "dtype": "fp32", "default_voice": "golden_speaker",
        "max_batch": 2, "warmup": False}}, cwd=run_dir)
    try:
        await serve.until_healthy(timeout=180)
        first, = serve.workers()
        shutil.rmtree(run_dir)
        os.kill(first, signal.SIGKILL)
        await serve.until(lambda _status, body: body["workers"]["cosyvoice2-0"]["pid"] not in (None, first)
                          and body["workers_ready"] == 1, timeout=180)
        assert "oneMKL" not in serve.log_path.read_text()
        await _heard(serve, tmp_path, "Hello again.", "after")
    finally:
        await stop_serve(serve)
