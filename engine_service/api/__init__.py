"""The speech API over HTTP and WebSocket: streaming TTS, jambonz's custom vendor API, bots, a try-it page.

The worker's server calls `add_tts_routes(app, engine, TtsApiSettings.from_mapping(config["tts_api"]))`.
This package speaks to the engine through `engines.base` only and never imports the gateway.
"""

from engine_service.api.routes import add_tts_routes
from engine_service.api.settings import ApiKey, TtsApiConfigError, TtsApiSettings

__all__ = ["ApiKey", "TtsApiConfigError", "TtsApiSettings", "add_tts_routes"]
