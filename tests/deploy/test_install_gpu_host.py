"""scripts/install_gpu_host.sh, as far as a host without a GPU can run it: its --dry-run prints every step in order
(the torch build for the driver's CUDA, the project from this checkout pinned by the lock, a config the gateway
accepts, the cache directory, the unit, doctor before start) and changes nothing; shellcheck finds nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gateway.config import load_config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install_gpu_host.sh"


def install(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="needs Debian's shellcheck (bootstrap installs it)")
def test_shellcheck_finds_nothing() -> None:
    scripts = [SCRIPT, REPO / "scripts" / "bootstrap.sh", REPO / "scripts" / "lock.sh",
               *sorted((REPO / "deploy" / "containers").glob("*.sh"))]
    result = subprocess.run(["shellcheck", *map(str, scripts)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_dry_run_prints_every_step_in_order_and_changes_nothing(tmp_path: Path) -> None:
    existed = Path("/etc/cosyvoice-gateway").exists(), Path("/opt/cosyvoice-gateway").exists()
    result = install("--dry-run", "--cuda-version", "12.9", "--gpus", "2", "--model-dir", "/opt/models/cv2",
                     "--allow", "10.0.0.0/8", "--advertised-host", "192.0.2.7")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    steps = [
        "torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128",  # 12.9 driver: the cu128 build
        f"install -q -c {REPO}/requirements.lock {REPO}\\[tts\\]",
        "+ write /etc/cosyvoice-gateway/gateway.yaml",
        "+ install -d -o cosyvoice -g cosyvoice -m 0750 /var/cache/cosyvoice-gateway",
        f"+ install -m 0644 {REPO}/systemd/cosyvoice-gateway.service /etc/systemd/system/cosyvoice-gateway.service",
        "ReadWritePaths=-/opt/models/cv2/voices",
        "+ systemctl daemon-reload",
        "doctor --config /etc/cosyvoice-gateway/gateway.yaml --cache-dir /var/cache/cosyvoice-gateway",
        "+ systemctl enable --now cosyvoice-gateway",
    ]
    positions = [out.find(step) for step in steps]
    assert -1 not in positions, [step for step, at in zip(steps, positions) if at == -1]
    assert positions == sorted(positions), "steps out of order"
    # the config it writes is one the gateway loads: both GPUs, the model directory, the trunk
    config_text = re.search(r"\+ write /etc/cosyvoice-gateway/gateway.yaml \(mode 0644\):\n(.*?)\n\+ end of",
                            out, re.DOTALL).group(1)
    (tmp_path / "gateway.yaml").write_text(config_text)
    config = load_config(tmp_path / "gateway.yaml")
    assert config.engine.cosyvoice2["devices"] == [0, 1]
    assert config.engine.cosyvoice2["model_dir"] == "/opt/models/cv2"
    assert [str(net) for trunk in config.trunks for net in trunk.allow] == ["10.0.0.0/8"]
    assert config.sip.advertised_host == "192.0.2.7"
    assert (Path("/etc/cosyvoice-gateway").exists(), Path("/opt/cosyvoice-gateway").exists()) == existed


@pytest.mark.parametrize(("driver_cuda", "tag"), [("13.1", "cu130"), ("13.0", "cu130"), ("12.8", "cu128"),
                                                  ("12.7", "cu126"), ("12.6", "cu126")])
def test_the_driver_gets_the_newest_torch_build_it_runs(driver_cuda: str, tag: str) -> None:
    result = install("--print-index-url", "--cuda-version", driver_cuda)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"https://download.pytorch.org/whl/{tag}"


def test_a_driver_too_old_is_told_to_upgrade() -> None:
    result = install("--print-index-url", "--cuda-version", "12.4")
    assert result.returncode == 1
    assert "older than every CUDA build of torch" in result.stderr and "upgrade the NVIDIA driver" in result.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this host has an NVIDIA driver")
def test_without_a_driver_it_says_what_to_install_first() -> None:
    result = install("--dry-run", "--model-dir", "/opt/models/cv2")
    assert result.returncode == 1
    assert "no NVIDIA driver (nvidia-smi not found): install it first" in result.stderr
    assert result.stdout == ""  # stopped before any step


def test_the_model_directory_is_required() -> None:
    result = install("--dry-run", "--cuda-version", "12.8", "--gpus", "1")
    assert result.returncode == 1 and "--model-dir is required" in result.stderr
