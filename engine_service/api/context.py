"""TtsApi: what every endpoint of the API shares (the engine, the settings, the per-key stream slots).

One instance per aiohttp application, stored under `TTS_API`; handlers read it from `request.app`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from aiohttp import web

from engine_service.api.access import StreamSlots
from engine_service.api.settings import TtsApiSettings
from engines.base import SpeechEngine


@dataclass
class TtsApi:
    engine: SpeechEngine
    settings: TtsApiSettings
    slots: StreamSlots = field(default_factory=StreamSlots)


TTS_API = web.AppKey("tts_api", TtsApi)
