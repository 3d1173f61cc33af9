"""bench/bench_worker_start.py on the CPU: a supervised instant worker, its first start and a kill -9 restart timed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_first_start_and_a_restart_after_kill_are_timed_with_calls_after_each(tmp_path: Path) -> None:
    out = tmp_path / "worker_start.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_worker_start.py"), "--engine", "instant",
                           "--restarts", "1", "--calls-after-ready", "1", "--limit-s", "60", "--out", str(out)],
                          capture_output=True, text=True, timeout=180, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert [s["kind"] for s in result["starts"]] == ["first", "restart 1 after kill -9"]
    for start in result["starts"]:
        assert 0 < start["ready_s"] < 60
        assert [c["status"] for c in start["calls_after_ready"]] == [200]
        assert start["calls_after_ready"][0]["first_speech_ms"] > 0
