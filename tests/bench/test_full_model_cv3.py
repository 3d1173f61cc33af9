"""bench/full_model.py --family 3 builds a CosyVoice3 directory the engine loads and speaks from, and bench/bench_load.py runs
on a CosyVoice3 directory. On CPU the builder runs at the tiny model's sizes: a `full/` folder made of the tiny
model's own key shapes, yaml and Qwen2 config stands in for ../shared/golden_cv3/full (the same recipe, smaller)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from full_model import build_full_model_dir  # noqa: E402


def _small_golden(golden3: Path, target: Path) -> Path:
    """A golden_cv3 look-alike whose `full/` holds the tiny model's sizes."""
    tiny = golden3 / "cosyvoice3_tiny"
    (target / "full" / "CosyVoice-BlankEN").mkdir(parents=True)
    (target / "cosyvoice3_tiny").symlink_to(tiny)
    keys = {part: {k: list(v.shape) for k, v in torch.load(tiny / f"{part}.pt", weights_only=False).items()}
            for part in ("llm", "flow", "hift")}
    (target / "full" / "full_keys.json").write_text(json.dumps(keys))
    shutil.copy(tiny / "cosyvoice3.yaml", target / "full" / "cosyvoice3_full.yaml")
    shutil.copy(tiny / "CosyVoice-BlankEN" / "config.json", target / "full" / "CosyVoice-BlankEN" / "config.json")
    return target


def test_the_built_directory_loads_strictly_and_speaks(golden3_dir: Path, tmp_path: Path) -> None:
    from tests.tts_core.test_voices import assert_speaks

    torch.set_num_threads(1)
    golden = _small_golden(golden3_dir, tmp_path / "golden")
    out = build_full_model_dir(tmp_path / "model", golden, family=3)
    flow = torch.load(out / "flow.pt", weights_only=False)
    official = torch.load(golden3_dir / "cosyvoice3_tiny" / "flow.pt", weights_only=False)
    key = "decoder.estimator.rotary_embed.inv_freq"  # a fixed buffer, not a random weight
    assert torch.allclose(flow[key], official[key])
    assert (out / "cosyvoice3.yaml").is_file()
    assert_speaks(out, "bench_voice")  # strict keys, the family read from the yaml


def test_bench_load_runs_on_a_cosyvoice3_directory(tiny3_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "bench_load.py"), "--model-dir", str(tiny3_model_dir),
                           "--device", "cpu", "--threads", "1", "--rates", "2", "--duration", "1", "--max-batch", "4",
                           "--min-tokens", "20", "--max-tokens", "40", "--one-stream-requests", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["family"] == 3
    assert report["rates"][0]["requests"] >= 1 and report["rates"][0]["failed"] == 0
    assert report["one_stream"][0]["first_chunk_ms"]["50"] > 0  # JSON keys are strings
