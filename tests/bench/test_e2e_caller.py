"""bench/e2e_caller.py times RTP by the kernel: a reader that is late still sees when each packet arrived."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from bench_e2e_calls import engine_jobs, first_chunk_stages, mixed_schedule  # noqa: E402
from e2e_caller import CallResult, RtpReceiver, _dialog_target, _host_port  # noqa: E402

PACE_S = 0.020


async def _send_train(port: int, seqs: list[int], speech_from: int) -> list[int]:
    """One packet per seq every 20 ms (silent PCMU before `speech_from`); the time.time_ns() after each send."""
    sent = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        start = time.monotonic()
        for i, seq in enumerate(seqs):
            await asyncio.sleep(max(0.0, start + i * PACE_S - time.monotonic()))
            payload = (b"\xff\x7f" if i < speech_from else b"\x10\x90") * 80
            sock.sendto(b"\x80\x00" + seq.to_bytes(2, "big") + bytes(8) + payload, ("127.0.0.1", port))
            if i == 12:  # another call's RTCP sender report, its length field (6) where RTP has a sequence number
                sock.sendto(b"\x80\xc8\x00\x06" + bytes(24), ("127.0.0.1", port))
            sent.append(time.time_ns())
    return sent


def test_a_late_reader_still_sees_the_packet_train_as_sent() -> None:
    seqs = [(65520 + i) % 65536 for i in range(30)]  # crosses the 16-bit wrap
    seqs = seqs[:20] + [(s + 1) % 65536 for s in seqs[20:]]  # one sequence number never sent: one lost
    result = CallResult(0)
    sent: list[int] = []

    async def receive() -> None:
        receiver = RtpReceiver(result, asyncio.get_running_loop())
        sender = threading.Thread(target=lambda: sent.extend(asyncio.run(_send_train(receiver.port, seqs, 5))))
        sender.start()
        await asyncio.sleep(0.1)
        time.sleep(0.2)  # the reader's loop is busy for ten packets' time: they queue in the kernel meanwhile
        while sender.is_alive():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)
        receiver.close()

    asyncio.run(receive())
    assert len(result.arrivals_ns) == 30
    assert result.lost == 1
    # each arrival is stamped as it reached the socket, within a few ms of its send (not 200 ms later)
    assert max(abs(a - s) for a, s in zip(result.arrivals_ns, sent, strict=True)) < 5_000_000
    assert result.first_speech_ns == result.arrivals_ns[5]


def test_engine_first_chunks_are_our_calls_tts_job_done_lines_past_the_offset(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    before = json.dumps({"event": "tts_job_done", "call_id": "e2e-0-1@127.0.0.1", "first_chunk_s": 9.0}) + "\n"
    log.write_text(before + "\n".join([
        json.dumps({"event": "call_answered", "call_id": "e2e-1-2@127.0.0.1"}),
        "Traceback (most recent call last): tts_job_done",
        json.dumps({"event": "tts_job_done", "call_id": "someone-else", "first_chunk_s": 5.0}),
        json.dumps({"event": "tts_job_done", "call_id": "e2e-1-2@127.0.0.1", "first_chunk_s": 0.071,
                    "first_chunk_decode_ms": 30.0, "first_chunk_render_ms": 35.0}),
        json.dumps({"event": "tts_job_done", "call_id": "e2e-2-3@127.0.0.1", "first_chunk_s": 0.25,
                    "first_chunk_decode_ms": 130.0, "first_chunk_render_ms": 95.0}),
    ]) + "\n")
    jobs = engine_jobs(log, len(before))
    assert [job["first_chunk_s"] for job in jobs] == [0.071, 0.25]
    stages = first_chunk_stages(jobs)
    assert set(stages) == {"decode", "render"}
    assert stages["decode"]["mean"] == 80.0 and stages["render"]["mean"] == 65.0


def test_the_bench_places_calls_from_two_caller_processes_and_merges_them(tmp_path: Path) -> None:
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e_calls.py"), "--engine", "instant",
                           "--calls", "2", "--caller-processes", "2", "--prompt-seconds", "1", "--start-timeout", "60",
                           "--out", str(out)], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    step = json.loads(out.read_text())["steps"][0]
    assert (step["answered"], step["caller_processes"], step["lost_packets"]) == (2, 2, 0)
    assert step["clock"] == "kernel SO_TIMESTAMPNS"
    assert 18.0 <= step["rtp_interval_p50_ms"] <= 22.0
    assert step["engine_first_chunk_p50_ms"] is None  # the instant engine logs no tts_job_done


def test_a_cached_step_hangs_up_after_hear_s_and_reads_the_gateways_clock_and_gc(tmp_path: Path) -> None:
    """The prompt is 3 s; every caller hangs up 1 s after its first speech, whatever the engine made."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e_calls.py"), "--engine", "instant",
                           "--calls", "--cached-calls", "4", "--uncached-calls", "0", "--ramp-s", "1", "--hear-s", "1",
                           "--prompt-seconds", "3", "--start-timeout", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    step = json.loads(out.read_text())["steps"][0]
    assert (step["answered"], step["prompt_cache"]["hits_total"]) == (4, 4)
    assert 0.9 <= step["heard_s_p50"] <= 1.3
    assert step["clock_ticks"] > 0 and step["clock_skipped_ticks"] >= 0 and step["gc_full_collections"] >= 0


def test_a_mixed_step_spreads_every_call_round_robin_over_the_gateways() -> None:
    other = ("127.0.0.1", 5070)
    schedule = mixed_schedule(6, 2, 4.0, "cached", "uncached", [other], hear_s=30.0)
    assert [p.sip for p in schedule].count(other) == 4
    assert all(p.hang_up_after_s == 30.0 for p in schedule)
    assert [p.user for p in schedule].count("uncached") == 2
    assert {p.user for p in schedule if p.sip == other} == {"cached", "uncached"}  # both gateways use the engine


def test_in_dialog_requests_follow_the_route_a_proxy_recorded() -> None:
    answer = {"contact": "<sip:gw@127.0.0.1:5080;transport=udp>",
              "record-route": "<sip:127.0.0.1:5060;lr;ftag=a>, <sip:10.0.0.1;lr>"}
    assert _dialog_target(answer, "sip:cached@127.0.0.1:5060") == (
        "sip:gw@127.0.0.1:5080;transport=udp", "Route: <sip:10.0.0.1;lr>, <sip:127.0.0.1:5060;lr;ftag=a>\r\n")
    assert _dialog_target({"contact": "<sip:gw@127.0.0.1:5080>"}, "sip:x@h:1") == ("sip:x@h:1", "")
    assert _host_port(answer["contact"]) == "127.0.0.1:5080"


def test_killing_one_of_two_workers_mid_step_ends_only_its_calls_and_times_its_return(tmp_path: Path) -> None:
    """--kill-worker-at with two supervised instant workers: the second is killed 1.5 s into 6-s calls;
    about half the calls (the gateway spreads them) end early with the gateway's BYE, the others play to
    the end, and the row says when /healthz had the worker back."""
    out = tmp_path / "e2e.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_e2e_calls.py"), "--engine", "instant",
                           "--workers", "2", "--calls", "8", "--rate", "20", "--prompt-seconds", "6",
                           "--kill-worker-at", "1.5", "--start-timeout", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    step = json.loads(out.read_text())["steps"][0]
    kill = step["kill"]
    assert kill["worker"] == "instant-1" and kill["pid"] > 0
    assert kill["healthz_noticed_s"] is not None and kill["healthz_ready_again_s"] is not None
    assert kill["connected_again_s"] is not None
    # The instant engine logs no job lines, so no call is attributed to a worker; the early BYEs show the kill.
    calls = step["unattributed"]
    assert calls["calls"] == step["answered"] == 8
    assert 1 <= calls["early_bye"] <= 7
    assert len(step["per_call"]) == 8 and all(c["worker"] is None for c in step["per_call"])


def test_calls_are_attributed_to_workers_by_their_job_lines_pid() -> None:
    from array import array

    from bench_e2e_calls import by_worker, worker_names

    assert worker_names({"engine": {"name": "cosyvoice2", "cosyvoice2": {"devices": [0, 1]}}}) == [
        "cosyvoice2-cuda:0", "cosyvoice2-cuda:1"]
    assert worker_names({"engine": {"name": "instant", "workers": 2}}) == ["instant-0", "instant-1"]
    assert worker_names({"engine": {"name": "cosyvoice2"}}) == ["cosyvoice2-0"]

    def call(call_id: str, packets: int, gap_at: int | None = None) -> CallResult:
        times = [i * 20_000_000 for i in range(packets)]
        if gap_at is not None:
            times = times[:gap_at] + [t + 100_000_000 for t in times[gap_at:]]
        return CallResult(0, status=200, call_id=call_id, arrivals_ns=array("q", times), bye_ns=1)

    answered = [call("a", 300), call("b", 40), call("c", 300, gap_at=100), call("d", 300)]
    jobs = [{"call_id": "a", "pid": 10}, {"call_id": "b", "pid": 11}, {"call_id": "c", "pid": 10}]
    row = by_worker(answered, jobs, {10: "w-0", 11: "w-1"}, killed="w-1")
    assert [c["worker"] for c in row["per_call"]] == ["w-0", "w-1", "w-0", None]
    assert (row["killed_worker"]["calls"], row["killed_worker"]["early_bye"]) == (1, 1)
    assert (row["other_workers"]["calls"], row["other_workers"]["early_bye"]) == (2, 0)
    assert row["other_workers"]["calls_with_gap_over_60ms"] == 1
    assert row["other_workers"]["rtp_interval_max_ms"] == 120.0
    assert row["unattributed"]["calls"] == 1
