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
    # compiled graph per region shape that every region of that shape runs (tiny: 4 levels of one
    # resnet and one transformer block; the middle two levels share theirs).
    assert 0 < compiled["extern_calls"] < compiled["total"] < eager
    calls = report["region_calls_per_step"]
    assert sum(v for k, v in calls.items() if k.startswith("block")) == 4
    assert sum(v for k, v in calls.items() if k.startswith("resnet")) == 4
    assert set(report["compiled_calls_per_region"]) == set(calls)
