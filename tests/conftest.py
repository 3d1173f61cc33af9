"""Shared fixtures: where the golden vectors live, and skips for tools a host may lack."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    path = Path(os.environ.get("COSYVOICE_GOLDEN_DIR", REPO_ROOT.parent / "shared" / "golden"))
    if not (path / "cases").is_dir():
        pytest.fail(f"golden vectors not found at {path} (set COSYVOICE_GOLDEN_DIR)")
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(golden_dir: Path) -> Path:
    return golden_dir / "cosyvoice2_tiny"


@pytest.fixture(scope="session")
def golden3_dir() -> Path:
    """The CosyVoice3 golden set (../shared/golden_cv3/README.md)."""
    path = Path(os.environ.get("COSYVOICE3_GOLDEN_DIR", REPO_ROOT.parent / "shared" / "golden_cv3"))
    if not (path / "cases").is_dir():
        pytest.fail(f"CosyVoice3 golden vectors not found at {path} (set COSYVOICE3_GOLDEN_DIR)")
    return path


@pytest.fixture(scope="session")
def tiny3_model_dir(golden3_dir: Path) -> Path:
    return golden3_dir / "cosyvoice3_tiny"


@pytest.fixture
async def espeak():
    """A started espeak engine (the embedded default), closed after the test."""
    from engines.espeak import EspeakEngine

    engine = EspeakEngine()
    await engine.start()
    yield engine
    await engine.close()
