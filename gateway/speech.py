"""What a call plays: line audio (8 kHz int16 at the configured level) from the prompt cache, or from the engine.

`CallSpeech.open` is the call layer's one way to speech. It settles every refusal before the call is answered:
the voice's fixed gain (measured once, speech_audio/voice_gain.py), then

- a cacheable prompt (`Prompt.cache` and `prompt_cache.enabled`): `PromptCache.open` -- a hit is the whole prompt
  at once (no engine stream, no slot); a miss opens the engine stream, waits for its admission (a refusal is the
  call's 503/4xx), and the fill streams to this call and to any call that asks for the same prompt meanwhile;
- otherwise: the engine stream of this call alone, converted as it arrives, cancelled when the call ends.

A voice's gain is measured at start for the prerendered prompts' voices (or read from its calibration audio in
the cache directory), else on its first call's own stream (`open` never waits for it).

The gateway fills the cache for SIP calls because it is the process that makes line audio (resampling and level
are done here, once per prompt); the workers' speech API fills its own store from its own streams.
"""

from __future__ import annotations

import errno
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog

from engines.base import SpeechEngine, SynthesisRequest
from engines.channel import ChunkChannel
from gateway.config_errors import ConfigError
from speech_audio.line_audio import LineAudio, line_chunks
from speech_audio.level import DEFAULT_SPEECH_LEVEL_DBM0
from speech_audio.prompt_cache import PromptCache
from speech_audio.prompt_store import PromptKey, PromptStore
from speech_audio.resample import TARGET_RATE
from speech_audio.voice_gain import CALIBRATION_TEXT, ENGINE_LEVEL, VoiceGains

log = structlog.get_logger(__name__)

LINE_RATE = TARGET_RATE


@dataclass(frozen=True)
class SpeechSettings:
    """The `prompt_cache` block and `media.speech_level_dbm0` (gateway/config.py documents the keys)."""

    cache_enabled: bool = True
    cache_directory: Path | None = None
    max_memory_bytes: int = 64 << 20
    max_disk_bytes: int | None = 1 << 30
    level_dbm0: float | None = DEFAULT_SPEECH_LEVEL_DBM0

    def call_speech(self, engine: SpeechEngine) -> CallSpeech:
        """Raises ConfigError naming prompt_cache.directory when it cannot be created or written."""
        try:
            store = PromptStore(self.cache_directory, self.max_memory_bytes, self.max_disk_bytes)
            if self.cache_directory is not None and not os.access(self.cache_directory, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            raise ConfigError([f"prompt_cache.directory: cannot use {self.cache_directory} "
                               f"({exc.strerror or exc})"]) from None
        cache = PromptCache(store)
        return CallSpeech(engine, cache, VoiceGains(cache, self.level_dbm0, LINE_RATE), self.cache_enabled)


@dataclass
class Speech:
    """One call's audio: `chunks` (int16 at LINE_RATE); `hit` when it came whole from the cache; `stream` the engine
    stream this call opened (None for a hit or for a fill another call started), `owned` when only this call reads it."""

    chunks: AsyncIterator[np.ndarray]
    hit: bool = False
    stream: ChunkChannel | None = None
    owned: bool = False

    def close(self) -> None:
        """The call is over: a stream this call owns alone is cancelled (a cache fill runs on for the next caller)."""
        if self.owned and self.stream is not None:
            self.stream.cancel()


class CallSpeech:
    def __init__(self, engine: SpeechEngine, cache: PromptCache, gains: VoiceGains, cache_enabled: bool) -> None:
        self.engine = engine
        self.cache = cache
        self.gains = gains
        self.cache_enabled = cache_enabled

    @property
    def level_label(self) -> str:
        target = self.gains.target_dbm0
        return ENGINE_LEVEL if target is None else f"{target:.1f}"

    def key(self, request: SynthesisRequest, rate: int = LINE_RATE) -> PromptKey:
        # An instruct or dialect is other audio of the same text and voice: part of the voice's key.
        voice = request.voice + "".join(f"|{k}={v}" for k, v in sorted(request.options.items()))
        return PromptKey(request.text, voice, self.engine.model_identity(request.voice), rate, self.level_label)

    async def gain_db(self, voice: str) -> float | None:
        calibration = SynthesisRequest(text=CALIBRATION_TEXT, voice=voice, call_id="level-calibration", paced=False)
        return await self.gains.gain_db(voice, self.engine.model_identity(voice),
                                        lambda: self._render(calibration, None, None))

    async def open(self, request: SynthesisRequest, cacheable: bool, rate: int = LINE_RATE) -> Speech:
        """Line audio at `rate` (the codec's clock rate); raises the engine's SynthesisRefused (the call is
        rejected with its SIP code) before any audio.

        A voice whose level was never measured (not prerendered, nor its calibration on disk) is measured on its
        first stream: that call plays at the engine's level under the limiter and is not cached (the cache never
        keeps audio under a level it was not made at); no call waits for a measurement or takes a second slot."""
        model = self.engine.model_identity(request.voice)
        measured, gain = self.gains.known(request.voice, model)
        if not measured and await self.gains.from_cache(request.voice, model):  # after a restart: from disk
            measured, gain = self.gains.known(request.voice, model)
        if not measured:  # this call plays at the engine's level, uncached; its audio measures the voice
            channel = await self._admitted(request)
            chunks = self.gains.measuring(request.voice, model, line_chunks(
                channel, LineAudio(self.engine.sample_rate, rate, 0.0)), rate)
            return Speech(chunks, stream=channel, owned=True)
        if cacheable and self.cache_enabled:
            opened: list[ChunkChannel] = []
            audio = await self.cache.open(self.key(request, rate), lambda: self._render(request, gain, opened, rate))
            return Speech(audio.chunks, hit=audio.hit, stream=opened[0] if opened else None)
        channel = await self._admitted(request)
        return Speech(line_chunks(channel, LineAudio(self.engine.sample_rate, rate, gain)), stream=channel,
                      owned=True)

    async def close(self) -> None:
        """Stop the cache fills still running."""
        await self.cache.close()

    async def prerender(self, request: SynthesisRequest) -> bool:
        """Render a prompt into the cache now (at start); True if it was already there."""
        gain = await self.gain_db(request.voice)
        audio = await self.cache.open(self.key(request), lambda: self._render(request, gain, None))
        async for _ in audio.chunks:
            pass
        return audio.hit

    async def _admitted(self, request: SynthesisRequest) -> ChunkChannel:
        channel = self.engine.open_stream(request)
        try:
            await channel.admitted()
        except BaseException:
            channel.cancel()
            raise
        return channel

    async def _render(self, request: SynthesisRequest, gain: float | None, opened: list[ChunkChannel] | None,
                      rate: int = LINE_RATE) -> AsyncIterator[np.ndarray]:
        channel = await self._admitted(request)
        if opened is not None:
            opened.append(channel)
        return _owned(channel, LineAudio(self.engine.sample_rate, rate, gain))


async def _owned(channel: ChunkChannel, line: LineAudio) -> AsyncIterator[np.ndarray]:
    try:
        async for pcm in line_chunks(channel, line):
            yield pcm
    finally:
        channel.cancel()
