"""Fixtures for the TTS API tests (helpers live in api_server.py)."""

from __future__ import annotations

import pytest


@pytest.fixture
async def espeak():
    from engines.espeak import EspeakEngine

    engine = EspeakEngine()
    await engine.start()
    yield engine
    await engine.close()
