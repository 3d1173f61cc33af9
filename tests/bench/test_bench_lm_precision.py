"""bench/bench_lm_precision.py runs on CPU with the tiny golden model and reports every comparison."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_bench_lm_precision_runs_on_cpu_tiny(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "precision.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_lm_precision.py"), "--model-dir",
                           str(tiny_model_dir), "--device", "cpu", "--threads", "1", "--requests", "2", "--tokens", "12",
                           "--out", str(out)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "nucleus overlap" in proc.stdout
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"bf16_vs_fp32", "fp16_vs_fp32", "fp8_vs_fp32", "fp8_vs_bf16"}
    for name, row in results.items():
        assert row["positions"] == 24
        assert 0.0 < row["overlap"] <= 1.0 + 1e-6 and row["kl"] >= -1e-6, name
    # Coarser rounding moves the distribution further: e4m3 keeps 3 mantissa bits, bf16 7, fp16 10.
    assert results["fp8_vs_fp32"]["kl"] > results["bf16_vs_fp32"]["kl"] > results["fp16_vs_fp32"]["kl"]
