"""InstantEngine: a model-free engine for load tests of the gateway's SIP and media paths.

It emits a speech-like test signal (a gliding voiced tone with a few harmonics, its amplitude
opened and closed at a syllable rate) whose length follows the text length, so a load test measures
the gateway, not a model. The signal depends only on the text (seeded by CRC-32, not `hash()`, which
changes per process), so runs are reproducible. Generation costs a few numpy operations per chunk on
one worker thread; an optional first-chunk delay imitates a model's time to first audio and is
scheduled on the event loop timer, so delays of many concurrent streams overlap instead of queueing.
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engines.base import SAMPLE_RATE, SpeechEngine, SynthesisFailed, SynthesisRequest
from engines.channel import ChunkChannel

_SYLLABLE_HZ = 4.0  # roughly the syllable rate of conversational speech
_HARMONICS = (1.0, 0.5, 0.3, 0.15)


def signal_seconds(text: str, ms_per_char: float, min_s: float, max_s: float) -> float:
    return min(max(len(text) * ms_per_char / 1000.0, min_s), max_s)


def render_test_signal(text: str, start: int, length: int) -> np.ndarray:
    """Samples [start, start+length) of the text's test signal; chunks join without a seam."""
    seed = zlib.crc32(text.encode("utf-8"))
    f0 = 100.0 + seed % 120  # a plausible voice pitch, different per text
    t = (start + np.arange(length)) / SAMPLE_RATE
    # 5 % pitch vibrato at 3 Hz; the phase is the closed-form integral of the frequency.
    phase = 2 * np.pi * f0 * (t - 0.05 / (2 * np.pi * 3.0) * np.cos(2 * np.pi * 3.0 * t))
    voiced = sum(a * np.sin(k * phase) for k, a in enumerate(_HARMONICS, start=1))
    envelope = np.sin(np.pi * _SYLLABLE_HZ * t) ** 2
    return (0.25 * envelope * voiced).astype(np.float32)


class InstantEngine(SpeechEngine):
    name = "instant"

    def __init__(self, voices: Sequence[str] = ("en", "zh"), default_voice: str = "en",
                 ms_per_char: float = 60.0, min_duration_s: float = 0.5, max_duration_s: float = 30.0,
                 chunk_ms: int = 200, first_chunk_delay_ms: float = 0.0) -> None:
        if default_voice not in voices:
            raise ValueError(f"engine.instant.default_voice: {default_voice!r} is not one of the voices")
        if chunk_ms <= 0:
            raise ValueError("engine.instant.chunk_ms: must be positive")
        self._voices = tuple(voices)
        self._default_voice = default_voice
        self._ms_per_char = ms_per_char
        self._min_s = min_duration_s
        self._max_s = max_duration_s
        self._chunk_samples = SAMPLE_RATE * chunk_ms // 1000
        self._first_chunk_delay_s = first_chunk_delay_ms / 1000.0
        self._worker: ThreadPoolExecutor | None = None

    def voices(self) -> Sequence[str]:
        return self._voices

    @property
    def default_voice(self) -> str:
        return self._default_voice

    async def start(self) -> None:
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="instant-synth")

    async def close(self) -> None:
        if self._worker is not None:
            await asyncio.to_thread(self._worker.shutdown, wait=True, cancel_futures=True)
            self._worker = None

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        worker = self._worker
        if worker is None:
            raise RuntimeError("instant engine is not running; call start() first")
        channel = ChunkChannel()
        seconds = signal_seconds(request.text, self._ms_per_char, self._min_s, self._max_s)

        def submit() -> None:
            try:
                worker.submit(self._render, request.text, seconds, channel)
            except RuntimeError:  # the engine closed while the first-chunk delay ran
                channel.fail(SynthesisFailed("instant engine closed"))

        if self._first_chunk_delay_s > 0:
            asyncio.get_running_loop().call_later(self._first_chunk_delay_s, submit)
        else:
            submit()
        return channel

    def _render(self, text: str, seconds: float, channel: ChunkChannel) -> None:
        total = int(seconds * SAMPLE_RATE)
        for start in range(0, total, self._chunk_samples):
            if channel.cancelled:
                return
            channel.put(render_test_signal(text, start, min(self._chunk_samples, total - start)))
        channel.finish()
