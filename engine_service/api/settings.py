"""The `tts_api` block of the worker's YAML config: who may speak, how much, and the defaults.

    tts_api:
      api_keys:                      # Bearer keys; a request without a listed key gets 401
        - name: jambonz              # shown in logs instead of the key
          key: "change-me-0123456789"
          max_streams: 20            # concurrent streams (HTTP responses + open WebSockets); more get 429
      max_text_chars: 2000           # longer texts get 413 (and a bot WebSocket's unflushed text, too)
      default_voice: null            # null: the engine's default voice
      default_sample_rate: 24000     # POST /v1/tts and the bot WebSocket when the client names no rate
      jambonz_sample_rate: 8000      # rate of jambonz's HTTP vendor API when nothing else says
      admission_timeout_s: 2.0       # an engine that has not taken a stream by then is full: 503, never a stall
      retry_after_s: 1               # the Retry-After of a 503
      max_key_failures: 20           # wrong or missing keys from one address per window; then 429 until it ends
      key_failure_window_s: 60
      reserved_call_slots: 0         # slots of each worker the API never takes: SIP calls always find them
      slow_client_timeout_s: 10      # a client that does not take its audio for this long is cut (slot freed)
      max_stream_buffer_bytes: 1048576  # audio made for one client and not yet sent; over it, see above
      play_url:                      # GET /v1/play.wav?text=...: prompt audio by URL (engine_service/api/play_url.py)
        max_age_s: 86400             # Cache-Control: max-age of its answers (PBX media caches keep it that long)
        cache_bytes: 67108864        # rendered prompts kept in this worker's memory; least recently used go first
        max_signed_ttl_s: 31536000   # a signed URL's exp= may lie at most this far ahead (a forged far future: 403)

`TtsApiSettings.from_mapping(block)` validates and raises `TtsApiConfigError`, whose lines start with the key
path (`tts_api.api_keys[1].max_streams: ...`), like the gateway's config. With no keys the API answers 401 to
everyone: the safe default for a process that may listen beyond loopback. Nothing here reads the environment.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine_service.api.audio_format import SAMPLE_RATES


class TtsApiConfigError(ValueError):
    """The block cannot be used; `errors` holds one 'key.path: problem' line per mistake."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ApiKey(_Section):
    name: str = Field(min_length=1)
    key: str = Field(min_length=16, description="the Bearer secret; 16 characters at least")
    max_streams: int = Field(default=10, ge=1)

    def __repr__(self) -> str:  # never print the secret
        return f"ApiKey(name={self.name!r}, max_streams={self.max_streams})"


class PlayUrlSettings(_Section):
    max_age_s: int = Field(default=86400, ge=0)
    cache_bytes: int = Field(default=64 << 20, ge=0)
    max_signed_ttl_s: int = Field(default=365 * 86400, ge=1)


class TtsApiSettings(_Section):
    api_keys: tuple[ApiKey, ...] = ()
    max_text_chars: int = Field(default=2000, ge=1)
    default_voice: str | None = None
    default_sample_rate: int = 24000
    jambonz_sample_rate: int = 8000
    admission_timeout_s: float = Field(default=2.0, gt=0)
    retry_after_s: int = Field(default=1, ge=1)
    max_key_failures: int = Field(default=20, ge=1)
    key_failure_window_s: float = Field(default=60.0, gt=0)
    reserved_call_slots: int = Field(default=0, ge=0)
    slow_client_timeout_s: float = Field(default=10.0, gt=0)
    max_stream_buffer_bytes: int = Field(default=1 << 20, ge=65536)
    play_url: PlayUrlSettings = PlayUrlSettings()

    @field_validator("api_keys")
    @classmethod
    def _unique(cls, keys: tuple[ApiKey, ...]) -> tuple[ApiKey, ...]:
        for attribute in ("name", "key"):
            seen: set[str] = set()
            for key in keys:
                value = getattr(key, attribute)
                if value in seen:
                    shown = key.name if attribute == "name" else f"of {key.name!r}"
                    raise ValueError(f"two keys share the {attribute} {shown}")
                seen.add(value)
        return keys

    @field_validator("default_sample_rate", "jambonz_sample_rate")
    @classmethod
    def _known_rate(cls, rate: int) -> int:
        if rate not in SAMPLE_RATES:
            raise ValueError(f"must be one of {', '.join(map(str, SAMPLE_RATES))}")
        return rate

    @classmethod
    def from_mapping(cls, block: Mapping[str, Any] | None, path: str = "tts_api") -> TtsApiSettings:
        try:
            return cls.model_validate(dict(block or {}))
        except ValidationError as exc:
            raise TtsApiConfigError([_error_line(path, error) for error in exc.errors()]) from None

    def key_for(self, secret: str) -> ApiKey | None:
        """The key whose secret this is; compared in constant time so timing reveals nothing of a key."""
        found = None
        for key in self.api_keys:
            if hmac.compare_digest(key.key.encode(), secret.encode("utf-8", "surrogateescape")):
                found = key
        return found

    def key_named(self, name: str) -> ApiKey | None:
        """The key called `name` (a signed URL names its key; the secret never travels)."""
        return next((key for key in self.api_keys if key.name == name), None)


def _error_line(path: str, error: Mapping[str, Any]) -> str:
    where = path
    for part in error["loc"]:
        where += f"[{part}]" if isinstance(part, int) else f".{part}"
    message = "unknown field" if error["type"] == "extra_forbidden" else error["msg"]
    return f"{where}: {message.removeprefix('Value error, ')}"
