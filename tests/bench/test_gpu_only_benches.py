"""The GPU-only benchmarks import on a machine without CUDA and refuse to run there with the reason
(CI has no GPU; their figures come from `device` runs, docs/PERF_NOTES.md)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["bench_hift.py", "bench_conv_layout.py", "bench_sdpa.py"])
def test_gpu_only_bench_imports_and_refuses_without_cuda(script: str, tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / script), "--out", str(out)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""}, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "needs CUDA" in proc.stderr
    assert not out.exists()
