"""TtsApi: what every endpoint of the API shares (the engine, the settings, the per-key stream slots).

One instance per aiohttp application, stored under `TTS_API`; handlers read it from `request.app`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from engine_service.api.access import StreamSlots
from engine_service.api.settings import TtsApiSettings
from engines.base import SpeechEngine


class SharedSlots(Protocol):
    """The worker's engine slots, shared with its gateway links, so an API stream counts where they count.

    `take()` claims one (False: none free, the API answers 503); `give_back()` returns it. Without it (None)
    the API relies on the engine's own refusals and health alone."""

    def take(self) -> bool: ...

    def give_back(self) -> None: ...


@dataclass
class TtsApi:
    engine: SpeechEngine
    settings: TtsApiSettings
    shared_slots: SharedSlots | None = None
    slots: StreamSlots = field(default_factory=StreamSlots)  # per API key


TTS_API = web.AppKey("tts_api", TtsApi)
