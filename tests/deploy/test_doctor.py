"""`cosyvoice-gateway doctor` as an operator runs it: a subprocess, real config files, a real model directory (the
tiny golden CosyVoice2 model, copied and broken on purpose), real sockets holding ports."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def write_config(tmp_path: Path, engine: dict | None = None, **sections) -> Path:
    config = {"sip": {"listen": f"127.0.0.1:{free_port(socket.SOCK_DGRAM)}", "transports": ["udp"]},
              "http": {"listen": f"127.0.0.1:{free_port()}"}, **sections}
    if engine is not None:
        config["engine"] = engine
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def doctor(config: Path, *args: str) -> tuple[int, dict[str, str]]:
    """Exit code and {check name: its line(s)}; the name is the second column of each line."""
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--config", str(config), *args],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert not result.stderr.strip(), result.stderr
    lines: dict[str, str] = {}
    name = ""
    for line in result.stdout.splitlines():
        if line.startswith("      -> "):
            lines[name] += "\n" + line
        else:
            match = re.match(r"(OK|FAIL|SKIP) +(.+?)  ", line)
            assert match, line
            name = match.group(2)
            lines[name] = line
    return result.returncode, lines


def cosyvoice2(model_dir: Path, device: str = "cpu") -> dict:
    return {"name": "cosyvoice2", "cosyvoice2": {"model_dir": str(model_dir), "device": device}}


def test_a_good_host_passes_every_check_that_applies(tmp_path: Path, tiny_model_dir: Path) -> None:
    code, lines = doctor(write_config(tmp_path, cosyvoice2(tiny_model_dir)), "--cache-dir", str(tmp_path))
    assert code == 0, lines
    assert lines["model directory"].startswith("OK"), lines["model directory"]
    assert "every key matching" in lines["model directory"]
    assert lines["voices"].startswith("OK") and "1 voice(s)" in lines["voices"]
    assert lines["compiler cache"].startswith("OK")
    assert lines["gpu"].startswith("SKIP") and "device is cpu" in lines["gpu"]  # said, not passed silently


def test_a_cosyvoice3_directory_is_checked_as_one(tmp_path: Path, tiny3_model_dir: Path) -> None:
    code, lines = doctor(write_config(tmp_path, cosyvoice2(tiny3_model_dir)), "--cache-dir", str(tmp_path))
    assert code == 0, lines
    assert lines["model directory"].startswith("OK") and "CosyVoice3: " in lines["model directory"]
    assert lines["voices"].startswith("OK") and "1 voice(s)" in lines["voices"]


def test_a_missing_model_file_is_named_with_what_to_do(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    (model / "flow.pt").unlink()
    code, lines = doctor(write_config(tmp_path, cosyvoice2(model)), "--cache-dir", str(tmp_path))
    assert code == 1
    assert lines["model directory"].startswith("FAIL")
    assert f"{model / 'flow.pt'}" in lines["model directory"]
    assert "-> the file named is missing" in lines["model directory"]


def test_a_checkpoint_whose_keys_do_not_match_fails(tmp_path: Path, tiny_model_dir: Path) -> None:
    """A state dict from another model (a key renamed) would fail the engine's strict load at start."""
    import torch

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    state = torch.load(model / "hift.pt", map_location="cpu", weights_only=True)
    first = next(iter(state))
    state["renamed." + first] = state.pop(first)
    torch.save(state, model / "hift.pt")
    code, lines = doctor(write_config(tmp_path, cosyvoice2(model)), "--cache-dir", str(tmp_path))
    assert code == 1
    assert lines["model directory"].startswith("FAIL")
    assert "hift.pt" in lines["model directory"] and first in lines["model directory"], lines["model directory"]


def test_a_truncated_voice_file_is_named(tmp_path: Path, tiny_model_dir: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    data = (model / "spk2info.pt").read_bytes()
    (model / "spk2info.pt").write_bytes(data[: len(data) // 2])
    code, lines = doctor(write_config(tmp_path, cosyvoice2(model)), "--cache-dir", str(tmp_path))
    assert code == 1
    assert lines["voices"].startswith("FAIL") and "spk2info.pt" in lines["voices"], lines["voices"]


def test_busy_ports_are_named_with_the_key_to_change(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sip, socket.socket() as worker:
        sip.bind(("127.0.0.1", 0))
        worker.bind(("127.0.0.1", 0))
        worker.listen()
        sip_port, worker_port = sip.getsockname()[1], worker.getsockname()[1]
        config = write_config(tmp_path, {"name": "espeak", "workers": 1, "worker": {"port": worker_port}},
                              sip={"listen": f"127.0.0.1:{sip_port}", "transports": ["udp"]})
        code, lines = doctor(config)
    assert code == 1
    assert lines["sip.listen udp"].startswith("FAIL")
    assert f"127.0.0.1:{sip_port}/udp is in use" in lines["sip.listen udp"]
    assert "change sip.listen" in lines["sip.listen udp"]
    worker_line = lines["worker port (espeak-0)"]
    assert worker_line.startswith("FAIL") and f"{worker_port}/tcp is in use" in worker_line
    assert "change engine.worker.port" in worker_line
    assert lines["http.listen"].startswith("OK")  # only what is busy fails


def test_a_config_typo_is_named_and_nothing_else_is_checked(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text("sip:\n  lisen: 127.0.0.1:5060\n")
    code, lines = doctor(config)
    assert code == 1
    assert list(lines) == ["config"]
    assert lines["config"].startswith("FAIL") and "sip.lisen" in lines["config"]
    assert "-> fix the key named" in lines["config"]


def test_a_missing_cache_directory_fails(tmp_path: Path) -> None:
    code, lines = doctor(write_config(tmp_path), "--cache-dir", str(tmp_path / "nowhere"))
    assert code == 1
    assert lines["compiler cache"].startswith("FAIL") and "does not exist" in lines["compiler cache"]
    assert "install -d -o cosyvoice" in lines["compiler cache"]


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has an NVIDIA driver")
def test_a_cpu_host_says_why_the_gpu_is_not_checked_or_fails_when_cuda_is_required(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    cache = ("--cache-dir", str(tmp_path))
    code, lines = doctor(write_config(tmp_path, cosyvoice2(tiny_model_dir, device="auto")), *cache)
    assert code == 0
    assert lines["gpu"].startswith("SKIP") and "nvidia-smi not found" in lines["gpu"]
    code, lines = doctor(write_config(tmp_path, cosyvoice2(tiny_model_dir, device="cuda")), *cache)
    assert code == 1
    assert lines["gpu"].startswith("FAIL") and "install the NVIDIA driver" in lines["gpu"]


def test_the_cuda_version_is_read_from_nvidia_smis_banner() -> None:
    from gateway.doctor import cuda_version_of

    banner = "| NVIDIA-SMI 550.54.15    Driver Version: 550.54.15    CUDA Version: 12.4     |"
    assert cuda_version_of(banner) == "12.4"
    assert cuda_version_of("no banner") is None


STAND_IN_NVIDIA_SMI = """#!/bin/sh
# A stand-in for the driver's tool on a host without a GPU: what nvidia-smi prints for two 80 GB GPUs.
case "$*" in
  *driver_version*) echo "570.86.15"; echo "570.86.15" ;;
  *memory.total*) echo "0, 81559, 1024"; echo "1, 81559, 60000" ;;
  *) echo "| NVIDIA-SMI 570.86.15   Driver Version: 570.86.15   CUDA Version: 12.8 |" ;;
esac
"""


def test_gpu_memory_is_weighed_against_max_batch_per_gpu(tmp_path: Path, tiny_model_dir: Path) -> None:
    """With a stand-in nvidia-smi (no GPU here: the parsing and the decision are what is tested, on the real
    doctor): GPU 0 has room for max_batch 64, GPU 1 (60 of 80 GB used) does not and is told the max_batch that
    fits; this host's torch is a CPU build, which fails with the way to the CUDA build."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(STAND_IN_NVIDIA_SMI)
    (bin_dir / "nvidia-smi").chmod(0o755)
    engine = {"name": "cosyvoice2", "cosyvoice2": {"model_dir": str(tiny_model_dir), "device": "cuda",
                                                   "devices": [0, 1], "max_batch": 64}}
    result = subprocess.run([sys.executable, "-m", "gateway.cli", "doctor", "--config",
                             str(write_config(tmp_path, engine)), "--cache-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    out = result.stdout
    assert result.returncode == 1
    assert re.search(r"OK +nvidia driver +driver 570.86.15, supports CUDA up to 12.8", out), out
    assert re.search(r"OK +gpu 0 memory +78.6 GB free, max_batch 64 needs about 28 GB", out), out
    assert re.search(r"FAIL +gpu 1 memory +21.1 GB free, max_batch 64 needs about 28 GB", out), out
    assert "lower engine.cosyvoice2.max_batch to 47" in out
    import torch

    if torch.version.cuda is None:
        assert re.search(r"FAIL +torch +torch .* is a CPU build", out) and "scripts/install_gpu_host.sh" in out
