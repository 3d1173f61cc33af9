"""bench/gpu_baseline.py runs on CPU with the tiny golden model and writes its JSON report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_gpu_baseline_runs_on_cpu_tiny(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "baseline.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_baseline.py"), "--model-dir", str(tiny_model_dir),
                           "--device", "cpu", "--threads", "1", "--tokens", "100", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "first chunk after" in proc.stdout
    report = json.loads(out.read_text())
    assert report["finite"] and report["audio_s"] == 100 * 960 / 24_000
    assert sum(c["tokens"] for c in report["chunks"]) == 100
    split = report["first_chunk_split"]
    assert set(split) == {"frontend_s", "prefill_s", "decode_s", "flow_s", "hift_s", "handoff_s", "other_s"}
    assert abs(sum(split.values()) - report["first_chunk_s"]) < 1e-6
