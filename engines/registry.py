"""Engine names -> constructors, imported lazily so CPU-only hosts never import GPU code."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from engines.base import SpeechEngine

# name -> "module:Class"; the class takes keyword settings from the config's `engine.<name>` block.
ENGINES: dict[str, str] = {
    "espeak": "engines.espeak:EspeakEngine",
    "instant": "engines.instant:InstantEngine",
    "cosyvoice2": "engines.cosyvoice2:CosyVoice2Engine",
    # engine workers (engine_service) reached over the streaming protocol; the gateway builds it from
    # engine.workers / engine.remote rather than by name
    "remote": "engines.remote:RemoteEngine",
}


# name -> "module:function" that checks an engine's settings block without loading anything heavy (no torch,
# no model): called at config load, so a typo is a one-line error naming the key, not a worker's traceback.
SETTINGS_CHECKS: dict[str, str] = {
    "cosyvoice2": "engines.cosyvoice2.settings:check_settings",
}


def check_settings(name: str, settings: Mapping[str, Any]) -> None:
    """Raise ValueError("engine.<name>.<key>: ...") for settings the engine would refuse at start."""
    if name in SETTINGS_CHECKS:
        module_name, function_name = SETTINGS_CHECKS[name].split(":")
        getattr(importlib.import_module(module_name), function_name)(settings)


def create_engine(name: str, settings: Mapping[str, Any] | None = None) -> SpeechEngine:
    if name not in ENGINES:
        raise ValueError(f"engine.name: unknown engine {name!r}; choose one of {', '.join(sorted(ENGINES))}")
    module_name, class_name = ENGINES[name].split(":")
    engine_class = getattr(importlib.import_module(module_name), class_name)
    return engine_class(**dict(settings or {}))
