"""requirements.lock pins every Python dependency the project declares, within pyproject's ranges, and never
torch or what only torch needs (installed on its own: CPU build in CI, the CUDA build on GPU hosts)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"


def pins() -> dict[str, str]:
    """The pins that apply to this Python (the lock is universal: a package may have one per Python range)."""
    found = {}
    for line in LOCK.read_text().splitlines():
        if line and not line.startswith((" ", "#")):
            requirement = Requirement(line)
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            (specifier,) = requirement.specifier
            assert specifier.operator == "==", line
            found[canonicalize_name(requirement.name)] = specifier.version
    return found


def declared() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    return [r for r in requirements if canonicalize_name(r.name) not in ("cosyvoice-gateway", "torch")
            and (r.marker is None or r.marker.evaluate({"extra": ""}))]


def test_every_declared_dependency_is_pinned_within_its_range() -> None:
    locked = pins()
    for requirement in declared():
        name = canonicalize_name(requirement.name)
        assert name in locked, f"{requirement} is not in requirements.lock: run scripts/lock.sh"
        assert requirement.specifier.contains(locked[name], prereleases=True), (
            f"requirements.lock pins {name}=={locked[name]}, outside pyproject's {requirement}: run scripts/lock.sh")


def test_torch_and_cuda_builds_stay_out_of_the_lock() -> None:
    text = LOCK.read_text()
    assert not re.search(r"^(torch|triton|nvidia-|cuda-)", text, re.MULTILINE)


def test_installs_use_the_lock() -> None:
    assert '-c "$root/requirements.lock"' in (REPO / "scripts" / "bootstrap.sh").read_text()
    assert "-c /src/requirements.lock" in (REPO / "deploy" / "containers" / "Containerfile").read_text()
