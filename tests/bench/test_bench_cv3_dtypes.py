"""bench/bench_cv3_dtypes.py runs on CPU with the tiny golden CosyVoice3 model and writes its JSON report; its
click measure (bench/edge_click.py) tells a cut from a fade."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from edge_click import edge_jumps  # noqa: E402

RATE = 24_000


def test_bench_cv3_dtypes_runs_on_cpu_tiny(golden3_dir: Path, tiny3_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "cv3.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_cv3_dtypes.py"), "--device", "cpu",
                           "--dtypes", "float32", "--golden", str(golden3_dir), "--model-dir", str(tiny3_model_dir),
                           "--texts", "1", "--tokens", "40", "--tiny-tokens", "40", "--threads", "1",
                           "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["passed"] and report["failed"] == []
    entry = report["dtypes"]["float32"]
    assert entry["golden_tiny"]["flow_mel_nonstream"] <= 1e-3 and all(entry["golden_tiny"]["finite"].values())
    stream = entry["full_streams"]["texts"]["en"]
    assert stream["audio_s"] == 40 * 960 / RATE and stream["audio_finite"] and stream["lm_logits"]["finite"]
    assert stream["rms_dbfs"] > report["silence_floor_dbfs"] and stream["first_chunk_ms"] > 0
    assert stream["click_start"] <= report["click_ratio_max"]


def test_a_model_that_makes_nan_fails_the_run_and_says_where(tiny3_model_dir: Path, tmp_path: Path) -> None:
    """The DiT's output projection poisoned with NaN: the dtype's streams fail (the warm-up's audio is not
    finite), the report says so, and the exit status is 1."""
    model = tmp_path / "nan_model"
    shutil.copytree(tiny3_model_dir, model)
    flow = torch.load(model / "flow.pt", weights_only=False)
    flow["decoder.estimator.proj_out.weight"].fill_(float("nan"))
    torch.save(flow, model / "flow.pt")
    out = tmp_path / "cv3.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_cv3_dtypes.py"), "--device", "cpu",
                           "--dtypes", "float32", "--skip-golden", "--model-dir", str(model), "--texts", "1",
                           "--tokens", "40", "--threads", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert not report["passed"]
    assert report["failed"] == [f"float32 full_streams: {report['dtypes']['float32']['full_streams']['error']}"]
    assert "non-finite audio" in report["failed"][0]


def test_a_stream_cut_at_full_level_is_a_click_and_a_faded_one_is_not() -> None:
    t = np.arange(RATE) / RATE
    tone = 0.8 * np.sin(2 * np.pi * 440 * t + 1.0)  # starts at 0.67 of full scale: a step from silence
    cut = edge_jumps(tone, RATE)
    assert cut.start > 1 and cut.step > 1  # the step from silence outgrows any jump inside the tone
    fade = np.minimum(1.0, np.minimum(t, t[::-1]) / 0.05)  # 50 ms in and out
    faded = edge_jumps(tone * fade, RATE)
    assert faded.start < 0.5 and faded.end < 0.5 and faded.step < 0.01
