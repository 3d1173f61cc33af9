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

from bench_e2e_calls import engine_jobs, first_chunk_stages  # noqa: E402
from e2e_caller import CallResult, RtpReceiver  # noqa: E402

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
