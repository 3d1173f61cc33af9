"""Each voice's gain to the configured line level, measured once per (voice, model identity).

The measurement speaks `CALIBRATION_TEXT` in the voice at the engine's own level, through the prompt cache (so a
restart with the cache directory costs nothing, and callers arriving together share one rendering), and takes its
active speech level (speech_audio/level.py); where no calibration ran (`measuring`), the voice's first stream of
`MIN_STREAM_S` or more, heard at the engine's level, is measured instead. Every stream of that voice then gets the same fixed gain: the level a
caller hears does not depend on the text, and does not pump within a stream the way a per-chunk gain would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import numpy as np
import structlog

from speech_audio.level import active_speech_dbm0, gain_db_for
from speech_audio.prompt_cache import PromptCache
from speech_audio.prompt_store import PromptKey

log = structlog.get_logger(__name__)

# Five of the Harvard sentences (IEEE Recommended Practice for Speech Quality Measurements, 1969: phonetically
# balanced, the usual material for level and quality measurement): ~11 s of speech, a stable active level. With
# espeak, other English texts came out within -1.5..+0.3 dB of it (short ones such as "Please hold." lowest).
CALIBRATION_TEXT = ("The birch canoe slid on the smooth planks. Glue the sheet to the dark blue background. "
                    "It is easy to tell the depth of a well. These days a chicken leg is a rare dish. "
                    "Rice is often served in round bowls.")
ENGINE_LEVEL = "engine"
MIN_STREAM_S = 2.0  # a voice's first stream measures it only if it is at least this long (a stable level)  # the PromptKey level of audio as the engine made it

RenderRaw = Callable[[], Awaitable[AsyncIterator[np.ndarray]]]


class VoiceGains:
    """`gain_db(voice, model, render)`: the voice's fixed gain in dB (None: the line keeps the engine's level),
    measured now if it never was; `known(voice, model)`: the gain if measured, without waiting."""

    def __init__(self, cache: PromptCache, target_dbm0: float | None, rate: int) -> None:
        self.cache = cache
        self.target_dbm0 = target_dbm0
        self.rate = rate
        self.measured: dict[tuple[str, str], float | None] = {}  # (voice, model) -> active level, dBm0

    def known(self, voice: str, model: str) -> tuple[bool, float | None]:
        """(measured, gain in dB): a line kept at the engine's level counts as measured, with no gain."""
        if self.target_dbm0 is None:
            return True, None
        if (voice, model) not in self.measured:
            return False, None
        return True, gain_db_for(self.measured[(voice, model)], self.target_dbm0)

    async def gain_db(self, voice: str, model: str, render_raw: RenderRaw) -> float | None:
        """`render_raw` speaks CALIBRATION_TEXT in `voice` at the engine's level (int16 at `rate`); it is only
        called when the voice was never measured for this model; its refusal propagates."""
        if self.target_dbm0 is None:
            return None
        if (voice, model) not in self.measured:
            audio = await self.cache.open(self._key(voice, model), render_raw)
            samples = audio.samples if audio.hit else np.concatenate([c async for c in audio.chunks] or [np.zeros(0, np.int16)])
            self._learn(voice, model, samples)
        return gain_db_for(self.measured[(voice, model)], self.target_dbm0)

    async def from_cache(self, voice: str, model: str) -> bool:
        """Measure the voice from its calibration audio if the cache keeps it (a restart with the cache directory),
        without the engine; True when the voice is measured now."""
        if self.known(voice, model)[0]:
            return True
        samples = await self.cache.lookup(self._key(voice, model))
        if samples is not None:
            self._learn(voice, model, samples)
        return samples is not None

    async def measuring(self, voice: str, model: str, chunks: AsyncIterator[np.ndarray],
                        rate: int) -> AsyncIterator[np.ndarray]:
        """`chunks` (a voice's first stream, at the engine's level) passed on as they come; once the stream has
        ended, with at least `MIN_STREAM_S` of audio, its active level becomes the voice's measurement."""
        heard: list[np.ndarray] = []
        async for pcm in chunks:
            heard.append(pcm)
            yield pcm
        samples = np.concatenate(heard) if heard else np.zeros(0, np.int16)
        if samples.size >= MIN_STREAM_S * rate and active_speech_dbm0(samples, rate) is not None:
            self._learn(voice, model, samples, rate)

    def _key(self, voice: str, model: str) -> PromptKey:
        return PromptKey(CALIBRATION_TEXT, voice, model, self.rate, ENGINE_LEVEL)

    def _learn(self, voice: str, model: str, samples: np.ndarray, rate: int | None = None) -> None:
        if (voice, model) in self.measured:
            return
        level = active_speech_dbm0(samples, rate or self.rate)
        self.measured[(voice, model)] = level
        log.info("voice_level_measured", voice=voice, active_dbm0=None if level is None else round(level, 2),
                 gain_db=round(gain_db_for(level, self.target_dbm0), 2))
