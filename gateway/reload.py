"""What SIGHUP changes in a running gateway, decided on two validated configs.

Reloaded without dropping a call: `trunks` (the INVITE allow-list), `voices`, `prompts` and `routes`
(what the next call says), and `logging` (level, and the log file reopened: logrotate's postrotate).
Calls in progress keep the prompt they were answered with.

Not reloaded: `sip`, `media`, `engine`, `prompt_cache`, `http`, `shutdown` and `mrcp` hold sockets, port ranges,
a cache and a loaded model; a change there is logged as needing a restart and the running values stay.

A new file that does not validate, or whose prompts name a voice the running engine lacks, is refused
as a whole with one logged error naming the keys; the running config stays. This module decides; the
app applies (gateway/app.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gateway.config import ConfigError, GatewayConfig

RELOADED = ("trunks", "voices", "prompts", "routes", "logging")
RESTART_ONLY = ("sip", "media", "engine", "prompt_cache", "http", "shutdown", "mrcp")


@dataclass(frozen=True)
class Reload:
    config: GatewayConfig  # the config to run with from now on
    changed: tuple[str, ...]  # reloaded sections whose value changed
    needs_restart: tuple[str, ...]  # sections that changed in the file but keep their running values


def plan_reload(running: GatewayConfig, new: GatewayConfig, engine_voices: Sequence[str]) -> Reload:
    """The config to adopt: `new`'s reloadable sections over `running`'s others. Raises ConfigError when
    the new prompts or routes name a voice the running engine does not have."""
    needs_restart = tuple(name for name in RESTART_ONLY if getattr(new, name) != getattr(running, name))
    adopted = running.model_copy(update={name: getattr(new, name) for name in RELOADED})
    problems = adopted.unknown_voices(engine_voices)
    if problems:
        raise ConfigError(problems)
    changed = tuple(name for name in RELOADED if getattr(new, name) != getattr(running, name))
    return Reload(adopted, changed, needs_restart)
