"""bench/bench_load.py runs on CPU with the tiny golden model and reports the load table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[2]


def test_bench_load_runs_on_cpu_tiny(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_load.py"), "--model-dir", str(tiny_model_dir),
                           "--device", "cpu", "--threads", "1", "--rates", "3", "--duration", "1", "--max-batch", "8",
                           "--min-tokens", "20", "--max-tokens", "40", "--one-stream-requests", "3",
                           "--first-chunk-hold-ms", "0", "200", "--defer-slack-s", "0.8", "0.3", "--settle-s", "0.5",
                           "--profile-rate", "3", "--profile-s", "0.2", "--host-waits",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "largest passing concurrency" in proc.stdout
    report = json.loads(out.read_text())
    rate = report["rates"][0]
    variants = [(r["defer_slack_s"], r["first_chunk_hold_ms"]) for r in report["rates"]]
    assert variants == [(0.8, 0), (0.8, 200), (0.3, 0), (0.3, 200)]  # every variant ran on the one start-up
    assert [(o["defer_slack_s"], o["first_chunk_hold_ms"]) for o in report["one_stream"]] == variants
    assert rate["requests"] >= 1 and rate["failed"] == 0
    # The largest passing concurrency is taken over every variant, counted in calls playing in the
    # steady window (--settle-s is set).
    passing = [r for r in report["rates"] if r["passes"]]
    best = report["max_concurrency_passing"]
    if passing:
        assert best["steady_playing_mean"] == max(r["steady"]["playing_mean"] for r in passing)
        assert (best["defer_slack_s"], best["first_chunk_hold_ms"]) in variants
    else:
        assert best is None
    assert report["compile_flow"] is False and report["compile_hift"] is False  # no graphs on CPU: nothing compiled
    # Profiled: the first variant of the named rate, and one lone request (on CPU: no kernels).
    assert [("gpu_trace" in r) for r in report["rates"]] == [True, False, False, False]
    assert report["rates"][0]["gpu_trace"]["from_s"] == 0.5 and "streams" in report["gpu_trace_alone"]
    # The steady window: only requests that arrived after --settle-s, and a rate is judged on them.
    for r in report["rates"]:
        steady = r["steady"]
        assert steady["from_s"] == 0.5 and steady["requests"] <= r["requests"]
        assert steady["underruns"] <= r["underruns"] and steady["playing_peak"] <= r["playing_peak"]
        judged_p95 = steady["first_chunk_ms"]["95"]
        assert r["passes"] == (r["failed"] == 0 and r["underruns"] == 0 and judged_p95 <= 300.0)
    assert rate["first_chunk_ms"]["50"] > 0 and rate["underruns"] >= 0
    assert set(report["first_chunk_split_1_stream"]) >= {"prefill_ms", "decode_ms", "flow_ms", "hift_ms"}
    one = report["one_stream"][0]
    assert one["requests"] == 3 and one["first_chunk_ms_min"] <= one["first_chunk_ms"]["50"] <= one["first_chunk_ms_max"]
    # The first-chunk stages are consecutive marks from submit to hand-off: none can be negative.
    assert set(rate["first_chunk_render"]["mean_ms"]) == {"flow", "hift"}  # CPU: eager flows, no stream times
    # Host waits, per rate: CPU runs no graphs (no launches to time), but every render call's
    # vocoder launches are timed, on the render threads only.
    for r in report["rates"]:
        waits = r["host_waits"]
        assert {"push_chunks", "gil_probe", "cpu", "cat", "Tensor.to", "Tensor.clone", "stalls"} <= set(waits)
        assert all("graph_launch" not in kinds for s in waits["stalls"].values() for kinds in s["during"].values())
        assert "graph_launch" not in waits
        assert waits["cpu"]["process_cores"] > 0 and "tts-decode" in waits["cpu"]["threads"]
        assert waits["gil_probe"]["bench-gil-probe"]["calls"] > 0
        assert set(waits["push_chunks"]) <= {"tts-render-later", "tts-render-first-0", "tts-render-first-1",
                                             "tts-render-first-2"}
        pushes = {thread.removeprefix("tts-render-"): t["calls"] for thread, t in waits["push_chunks"].items()}
        assert pushes == {lane: x["calls"] for lane, x in r["render"].items()}  # one per render call
    stages = rate["first_chunk_split"]["mean_ms"]
    assert set(stages) == {"submit", "queue", "prefill", "decode", "render_wait", "render"}
    assert all(v >= 0 for v in stages.values()) and stages["decode"] > 0 and stages["render"] > 0
    assert rate["decode_thread"]["iteration_ms_mean"] >= rate["decode_thread"]["decode_ms_mean"] > 0


def test_calls_playing_are_counted_inside_the_window_only() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from bench_load import in_window

    spans = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0)]
    assert in_window(spans, 1.0, 2.0) == (2.0, 2)  # both overlap the whole window
    assert in_window(spans, 0.0, 4.0) == (1.0, 2)  # 2 + 2 call-seconds over 4 s; the third is outside
    assert in_window(spans, 3.5, 4.5) == (0.0, 0)


def test_a_first_chunks_render_split_takes_segment_zeros_first_chunk_and_its_stream_times() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from bench_load import first_chunk_render

    from tts_core.runtime.request import ChunkTiming

    def job(*chunks: ChunkTiming) -> SimpleNamespace:
        return SimpleNamespace(timings=SimpleNamespace(chunks=list(chunks), frontend_s=0.001, prefill_s=0.003))

    def chunk(segment: int, index: int, flow_s: float, gpu: tuple[float, float] | None,
              hift: tuple[float, float] | None = None) -> ChunkTiming:
        return ChunkTiming(segment, index, 25, 0.0, flow_s, 0.002, 0.0, 1.0, 0.1, gpu, hift)

    jobs = [job(chunk(0, 0, 0.060, (0.002, 0.040), (0.0005, 0.001)), chunk(0, 1, 0.5, (0.1, 0.4), (0.1, 0.1))),
            job(chunk(0, 0, 0.080, (0.004, 0.050), (0.0015, 0.003)), chunk(1, 0, 0.9, (0.2, 0.7), (0.2, 0.2))),
            job()]  # no chunk yet: left out
    split = first_chunk_render(jobs)
    assert split["mean_ms"] == {"flow": 70.0, "flow_encoder_gpu": 3.0, "flow_solve_gpu": 45.0, "hift": 2.0,
                                "hift_launch": 1.0, "hift_gpu": 2.0}
    assert split["p95_ms"]["flow"] == 79.0
    # A vocoder call that was not timed leaves only its wall time.
    assert "hift_gpu" not in first_chunk_render([job(chunk(0, 0, 0.06, (0.002, 0.04)))])["mean_ms"]
    # Untimed flows (eager, CPU) report wall times only.
    assert set(first_chunk_render([job(chunk(0, 0, 0.06, None))])["mean_ms"]) == {"flow", "hift"}
    assert first_chunk_render([job()]) == {}


def test_stalls_are_attributed_to_the_long_calls_they_overlap() -> None:
    sys.path.insert(0, str(REPO / "bench"))
    from host_waits import stall_overlap

    stalls = [("graph_launch", "later", 1.0, 1.1),
              ("solve_replay", "later", 0.99, 1.11),  # holds the launch: not a stall of its own
              ("Event.record", "decode", 1.05, 1.15),  # half inside later's launch
              ("Event.record", "decode", 1.12, 1.13),  # inside the first: one stall of 0.1 s, not two
              ("Tensor.to", "decode", 2.0, 2.1),  # outside every launch
              ("push_chunks", "first", 0.0, 3.0),  # holds other timed calls: not a stall of its own
              ("graph_launch", "first", 2.05, 2.2)]
    out = stall_overlap(stalls)
    decode = out["decode"]
    assert decode["stalls"] == 2 and decode["stall_ms"] == 200.0
    assert decode["during"]["later"] == {"graph_launch": 0.25, "solve_replay": 0.3}  # 50 and 60 of 200 ms
    assert decode["during"]["first"] == {"graph_launch": 0.25, "push_chunks": 1.0}
    assert out["later"]["during"]["decode"] == {"Event.record": 0.5, "Tensor.to": 0.0}
    assert out["first"]["stall_ms"] == 150.0 and out["first"]["during"]["later"]["graph_launch"] == 0.0
