"""bench/count_flow_ops.py runs on CPU with the tiny golden model; the compiled step launches fewer kernels."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_count_flow_ops_runs_on_cpu_tiny(tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "count_flow_ops.py"), "--model-dir", str(tiny_model_dir),
                           "--compiled", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    eager, compiled = report["eager_ops_per_step"], report["compiled_calls_per_step"]
    # Every transformer block and resnet dispatches its matmuls, norms and pool reads/writes...
    assert report["eager_ops_by_name"]["scaled_dot_product_attention"] >= 1 and eager > 50
    # ...and inductor keeps the matmuls/convolutions/attention as calls but fuses the rest, in one
    # compiled block that every transformer block of the step runs.
    assert 0 < compiled["extern_calls"] < compiled["total"] < eager
    assert report["compiled_sources"] == 1 and report["blocks_per_step"] == 4  # tiny: 1 + 2 mid + 1 levels
    assert compiled["total"] == compiled["eager_outside_blocks"] + 4 * report["compiled_calls_per_block"]["total"]
