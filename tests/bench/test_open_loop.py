"""bench/bench_open_loop.py: seeded Poisson arrivals, the zero-underrun gate, first audible audio, and a whole run
against a real `serve` (SIP calls and the workers' speech API) that writes a valid result file."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from arrivals import TAIL, WARMUP, WINDOW, plan_arrivals, poisson_times  # noqa: E402
from audible import AUDIBLE_DBFS, first_audible_sample, frame_dbfs, g711_audible  # noqa: E402
from e2e_caller import CallResult, RtpReceiver  # noqa: E402
from open_loop_gate import Outcome, highest_passing_rate, playback_underruns, run_figures  # noqa: E402

from speech_audio.g711 import encode  # noqa: E402


# -- arrivals -------------------------------------------------------------------------------------------------
def test_poisson_arrivals_are_seeded_and_have_the_asked_mean_rate_and_exponential_gaps() -> None:
    times = poisson_times(10.0, 1000.0, seed=7)
    assert np.array_equal(times, poisson_times(10.0, 1000.0, seed=7))  # the same seed, the same arrivals
    assert not np.array_equal(times[:100], poisson_times(10.0, 1000.0, seed=8)[:100])
    # 10,000 expected, standard deviation 100: +-6 sd (and the draw is seeded, so this cannot flake)
    assert 9400 <= len(times) <= 10600
    assert times.min() >= 0 and times.max() < 1000.0 and np.all(np.diff(times) > 0)
    gaps = np.diff(times)
    # exponential gaps: coefficient of variation 1 (a constant rate would be 0); sd of the estimate ~0.01
    assert 0.9 <= gaps.std() / gaps.mean() <= 1.1
    # arrivals per second are Poisson: variance ~ mean (10), unlike a constant rate (0)
    per_second = np.bincount(times.astype(int), minlength=1000)
    assert 8.0 <= per_second.var() <= 12.0


def test_a_plan_has_warmup_window_and_tail_in_order_with_seeded_prompts() -> None:
    plan = plan_arrivals(5.0, 3, warmup_s=10.0, window_s=20.0, tail_s=10.0, prompts_s=[3.0, 10.0, 30.0])
    assert plan == plan_arrivals(5.0, 3, 10.0, 20.0, 10.0, [3.0, 10.0, 30.0])
    assert [a.index for a in plan] == list(range(len(plan)))
    phases = [a.phase for a in plan]
    assert phases == sorted(phases, key=[WARMUP, WINDOW, TAIL].index)  # warm-up, then window, then tail
    assert all((a.phase == WINDOW) == (10.0 <= a.at_s < 30.0) for a in plan)
    assert {a.prompt_s for a in plan} == {3.0, 10.0, 30.0}


# -- first audible audio --------------------------------------------------------------------------------------
def _tone(dbfs: float, samples: int = 160, rate: int = 8000) -> np.ndarray:
    amplitude = 32768 * 10 ** (dbfs / 20) * np.sqrt(2)  # RMS at `dbfs`
    return np.rint(amplitude * np.sin(2 * np.pi * 440 * np.arange(samples) / rate)).astype(np.int16)


@pytest.mark.parametrize("codec,payload_type", [("PCMU", 0), ("PCMA", 8)])
def test_g711_frames_are_audible_from_minus_40_dbfs(codec: str, payload_type: int) -> None:
    assert not g711_audible(encode(np.zeros(160, np.int16), codec), payload_type)  # silence
    assert not g711_audible(encode(_tone(-55.0), codec), payload_type)  # not zero codes, yet not audible
    assert g711_audible(encode(_tone(-30.0), codec), payload_type)
    assert not g711_audible(encode(_tone(-30.0), codec), 101)  # a telephone-event is no audio
    assert frame_dbfs(_tone(-30.0)) == pytest.approx(-30.0, abs=0.3)


def test_the_first_audible_frame_of_a_pcm_stream_is_found_where_speech_starts() -> None:
    stream = np.concatenate([np.zeros(480, np.int16), _tone(-60.0, 960, 24000), _tone(-25.0, 4800, 24000)])
    assert first_audible_sample(stream, 24000) == 480 + 960  # 20 ms frames of 480 samples at 24 kHz
    assert first_audible_sample(stream[:1440], 24000) is None
    assert AUDIBLE_DBFS == -40.0


def test_the_caller_tells_first_speech_from_first_audible_audio() -> None:
    """RTP packets: silence codes, then a quiet tone (speech, not audible), then a loud one."""
    payloads = [encode(np.zeros(160, np.int16), "PCMU")] * 3 + [encode(_tone(-55.0), "PCMU")] * 3 + \
        [encode(_tone(-20.0), "PCMU")] * 4
    result = CallResult(0)

    async def receive() -> None:
        receiver = RtpReceiver(result, asyncio.get_running_loop())

        def send() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                for seq, payload in enumerate(payloads):
                    sock.sendto(b"\x80\x00" + seq.to_bytes(2, "big") + bytes(8) + payload, ("127.0.0.1", receiver.port))
                    time.sleep(0.005)  # a sender thread's spacing, so arrivals have distinct timestamps

        sender = threading.Thread(target=send)
        sender.start()
        while sender.is_alive():
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)  # the last datagrams read
        receiver.close()

    asyncio.run(receive())
    assert len(result.arrivals_ns) == 10
    assert result.first_speech_ns == result.arrivals_ns[3]
    assert result.first_audible_ns == result.arrivals_ns[6]


# -- the gate -------------------------------------------------------------------------------------------------
def test_a_player_fed_on_time_never_runs_dry_and_one_late_chunk_is_one_underrun() -> None:
    # 200 ms chunks, each arriving 100 ms before playback needs it; playback starts at t=1.0 at audio 0.0
    on_time = [(1.0 + 0.2 * i - 0.1 if i else 1.0, 0.2 * (i + 1)) for i in range(20)]
    assert playback_underruns(on_time, 1.0, 0.0) == (0, 0.0)
    late = list(on_time)
    late[8] = (late[8][0] + 0.3, late[8][1])  # needed at 2.6, arrives at 2.8: dry for 0.2 s
    late[9] = (max(late[9][0], late[8][0]), late[9][1])  # the ones after it come no earlier
    underruns, stalled = playback_underruns(late, 1.0, 0.0)
    assert underruns == 1 and stalled == pytest.approx(0.2)  # the stall shifts playback: counted once
    # audio before the first audible frame is not played, so it cannot run dry
    assert playback_underruns([(0.5, 0.1), (1.0, 0.3), (1.15, 0.5)], 1.0, 0.1) == (0, 0.0)


def test_the_gate_fails_a_run_with_one_underrun_and_passes_one_with_none() -> None:
    clean = [Outcome(first_audible_ms=100.0 + i, x_real_time=1.2) for i in range(50)]
    passed = run_figures(clean, window_underruns=0)
    assert passed["gate"] == "pass" and passed["gate_failed_on"] == []
    assert (passed["measured"], passed["answered"], passed["first_audible_p50_ms"]) == (50, 50, 124.5)
    one = run_figures(clean[:-1] + [Outcome(first_audible_ms=120.0, x_real_time=1.0, underruns=1)], 0)
    assert one["gate"] == "fail" and one["underruns"] == 1 and one["requests_with_underruns"] == 1
    assert run_figures(clean, window_underruns=1)["gate"] == "fail"  # the server's own count in the window
    assert run_figures(clean + [Outcome(gaps_over_60ms=1, first_audible_ms=90.0)])["gate"] == "fail"
    refused = run_figures(clean + [Outcome(refusal="503 at_capacity")])
    assert refused["gate"] == "fail" and refused["refusals"] == {"503 at_capacity": 1}
    slow = run_figures([Outcome(first_audible_ms=350.0)] * 10 + clean)
    assert slow["gate"] == "fail" and "first audible p95" in slow["gate_failed_on"][0]
    assert run_figures([])["gate"] == "fail"  # nothing measured proves nothing


def test_the_highest_passing_rate_is_below_the_first_rate_a_seed_failed() -> None:
    rows = [{"rate_per_s": r, "seed": s, "gate": g} for r, s, g in [
        (1, 1, "pass"), (1, 2, "pass"), (3, 1, "pass"), (3, 2, "pass"), (10, 1, "pass"), (10, 2, "fail"),
        (20, 1, "pass"), (20, 2, "pass")]]
    assert highest_passing_rate(rows) == 3
    assert highest_passing_rate(rows[:2]) == 1
    assert highest_passing_rate([{"rate_per_s": 1, "seed": 1, "gate": "fail"}]) is None


# -- a whole run ----------------------------------------------------------------------------------------------
def test_a_short_sweep_against_a_supervised_instant_serve_writes_a_valid_result_file(tmp_path: Path) -> None:
    out = tmp_path / "open_loop.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_open_loop.py"), "--engine", "instant",
                           "--workers", "1", "--first-chunk-delay-ms", "70", "--rates", "2", "--api-rates", "3",
                           "--seeds", "1",
                           "--warmup", "1", "--window", "3", "--prompt-seconds", "1", "--api-prompt-seconds", "1",
                           "2", "--start-timeout", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["engine"] == "instant" and "bench_open_loop.py" in report["command"]
    assert report["method"]["arrivals"] == "Poisson"
    for mode in ("sip", "api"):
        (run,) = report[mode]["runs"]
        rate = 2.0 if mode == "sip" else 3.0  # the speech API at its own rate, in the same start-up
        assert (run["rate_per_s"], run["seed"]) == (rate, 1)
        assert run["measured"] >= 1 and run["answered"] == run["measured"] and run["refused"] == 0
        assert run["never_audible"] == 0
        # the instant engine's first chunk is 70 ms late: nobody hears anything sooner
        assert run["first_audible_p50_ms"] >= 70.0
        assert run["gate"] in ("pass", "fail") and isinstance(run["gate_failed_on"], list)
        assert report[mode]["highest_passing_rate_per_s"] in (None, rate)
    assert report["sip"]["runs"][0]["calls_without_media_closed_line"] == 0  # each call's underruns were read
    assert report["sip"]["runs"][0]["window_underruns_server"] is not None
    sip = report["sip"]["runs"][0]  # the times a call's playout ran dry: none without a silent slot, else some
    assert (sip["underrun_events"] == 0) == (sip["underruns"] == 0) == (sip["first_underrun_s"] is None)
    gateway = report["sip"]["runs"][0]["gateway"]  # the packet clock's own view, to tell whose a gap was
    assert gateway["clock_ticks"] > 0 and 0 <= gateway["clock_late_over_20ms_pct"] <= 100
