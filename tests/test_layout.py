"""The package boundaries a newcomer relies on, checked on every import statement (lazy ones too).

- gateway/ never imports tts_core, and of engine_service only the wire protocol (engine_service.protocol);
- engines/ reaches tts_core only from engines/cosyvoice2;
- tts_core knows nothing of the gateway, the engines, the engine service or asyncio (thread-safe API only);
- connection_caps (listener caps both processes use) and speech_audio (codecs, resampling, level, the prompt
  cache) import none of them.

Imports are read with `ast`, so a boundary crossed inside a function (an import kept lazy for start-up
time) is caught as well as one at the top of a module.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Rule:
    package: str  # a top-level folder of the repository
    forbidden: tuple[str, ...]  # module prefixes it must not import
    allowed: tuple[str, ...] = ()  # exceptions to `forbidden` (exact modules or their submodules)
    exempt: tuple[str, ...] = ()  # sub-packages the rule does not cover

    def breaks(self, module: str) -> bool:
        return _within(module, self.forbidden) and not _within(module, self.allowed)


RULES = (
    Rule("gateway", forbidden=("tts_core", "engine_service"), allowed=("engine_service.protocol",)),
    Rule("engines", forbidden=("tts_core",), exempt=("engines.cosyvoice2",)),
    Rule("tts_core", forbidden=("gateway", "engines", "engine_service", "asyncio")),
    Rule("connection_caps", forbidden=("gateway", "engines", "engine_service", "tts_core")),
    Rule("speech_audio", forbidden=("gateway", "engines", "engine_service", "tts_core")),
)


def _within(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in prefixes)


def imported_modules(source: str, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) for every import in `source`, relative imports resolved.
    `from a import b` yields `a.b`, whether b is a submodule or a name a's __init__ defines: either
    way it is a's business, and `from engine_service import protocol` stays the protocol only."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")
                anchor = parts[: len(parts) - node.level + (1 if is_package else 0)]
                base = ".".join([*anchor, *([base] if base else [])])
            found += [(node.lineno, base if alias.name == "*" else f"{base}.{alias.name}") for alias in node.names]
    return found


def violations(rule: Rule) -> list[str]:
    problems = []
    for path in sorted((REPO / rule.package).rglob("*.py")):
        relative = path.relative_to(REPO)
        module = ".".join(relative.with_suffix("").parts).removesuffix(".__init__")
        if _within(module, rule.exempt):
            continue
        for line, name in imported_modules(path.read_text(encoding="utf-8"), module, path.name == "__init__.py"):
            if rule.breaks(name):
                problems.append(f"{relative}:{line} imports {name}")
    return sorted(set(problems))


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.package)
def test_package_keeps_its_boundary(rule: Rule) -> None:
    assert (REPO / rule.package).is_dir()
    assert violations(rule) == []


def test_the_check_sees_lazy_relative_and_from_imports() -> None:
    """The reader must catch the forms a real violation would take, or the tests above prove nothing."""
    source = ("import asyncio\n"
              "def load():\n    from tts_core.runtime import Pipeline\n"
              "from engine_service import protocol, server\n"
              "from ..gateway import app\n")
    names = {name for _, name in imported_modules(source, "tts_core.flow.decoder", is_package=False)}
    assert {"asyncio", "tts_core.runtime.Pipeline", "engine_service.protocol", "engine_service.server",
            "tts_core.gateway.app"} <= names
    gateway, _, tts_core, *_ = RULES
    assert gateway.breaks("tts_core.runtime") and gateway.breaks("engine_service.server")
    assert not gateway.breaks("engine_service.protocol") and not gateway.breaks("engines.base")
    assert tts_core.breaks("asyncio") and not tts_core.breaks("asyncio_helpers")
