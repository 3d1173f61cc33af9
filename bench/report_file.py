"""Where a benchmark's JSON report goes: bench/results/<name>_<date>[_<tag>].json unless --out says."""

from __future__ import annotations

import json
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_report(report: dict, out: Path | None, name: str, tag: str = "") -> Path:
    """Write `report` as indented JSON to `out` (default: the dated results file) and say where."""
    path = out or RESULTS / f"{name}_{time.strftime('%Y-%m-%d')}{'_' + tag if tag else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {path}")
    return path
