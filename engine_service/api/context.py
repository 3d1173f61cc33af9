"""TtsApi: what every endpoint of the API shares (the engine, the settings, the per-key stream slots, the prompt
cache the play URL serves from).

One instance per aiohttp application, stored under `TTS_API`; handlers read it from `request.app`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from engine_service.api.access import KeyFailures, StreamSlots
from engine_service.api.client_pace import StreamBuffers
from engine_service.api.settings import TtsApiSettings
from engines.base import SpeechEngine
from speech_audio.prompt_cache import PromptCache
from speech_audio.prompt_store import PromptStore


class SharedSlots(Protocol):
    """The worker's engine slots, shared with its gateway links, so an API stream counts where they count.

    `take(keep_free)` claims one unless that would leave fewer than `keep_free` free (False: the API answers
    503; tts_api.reserved_call_slots keeps those for SIP calls); `give_back()` returns it. Without it (None)
    the API relies on the engine's own refusals and health alone."""

    def take(self, keep_free: int = 0) -> bool: ...

    def give_back(self) -> None: ...


class StreamEvents(Protocol):
    """Where the API reports its admitted streams, to be counted with the worker's gateway streams
    (engine_service/metrics.py labels them by route). `outcome`: completed, failed or cancelled."""

    def opened(self) -> None: ...

    def ended(self, outcome: str) -> None: ...


@dataclass
class TtsApi:
    engine: SpeechEngine
    settings: TtsApiSettings
    shared_slots: SharedSlots | None = None
    slots: StreamSlots = field(default_factory=StreamSlots)  # per API key
    stream_events: StreamEvents | None = None  # set by the worker's metrics (WorkerMetrics.watch_api)
    key_failures: KeyFailures = field(init=False)  # wrong keys per source
    buffers: StreamBuffers = field(default_factory=StreamBuffers)  # audio waiting for slow clients
    # The one prompt cache (speech_audio.PromptCache, as the gateway's calls use), in this worker's memory up to
    # tts_api.play_url.cache_bytes: rendered play-URL prompts, one render per key however many ask at once.
    prompt_cache: PromptCache = field(init=False)

    def __post_init__(self) -> None:
        self.key_failures = KeyFailures(self.settings.max_key_failures, self.settings.key_failure_window_s)
        self.prompt_cache = PromptCache(PromptStore(None, self.settings.play_url.cache_bytes))


TTS_API = web.AppKey("tts_api", TtsApi)
