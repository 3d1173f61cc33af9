"""InstantEngine: a model-free engine for load tests of the gateway's SIP and media paths.

It emits a speech-like test signal (a gliding voiced tone with a few harmonics, its amplitude
opened and closed at a syllable rate) whose length follows the text length, so a load test measures
the gateway, not a model. The signal depends only on the text (seeded by CRC-32, not `hash()`, which
changes per process), so runs are reproducible. An optional first-chunk delay imitates a model's time
to first audio and is scheduled on the event loop timer, so delays of many concurrent streams overlap
instead of queueing.

One worker thread serves all streams round-robin, one chunk per turn, so a new call's first chunk
never waits behind whole prompts of earlier calls (with 500 calls arriving at once, rendering each
prompt in full before the next made the last call wait seconds for its first packet). A text's
signal is rendered once and cached (a small LRU), so a turn is mostly a slice.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from engines.base import GRAPHS_STATES, SAMPLE_RATE, EngineHealth, SpeechEngine, SynthesisFailed, SynthesisRequest
from engines.channel import ChunkChannel
from engines.segmented import speak_segments

_SYLLABLE_HZ = 4.0  # roughly the syllable rate of conversational speech
_HARMONICS = (1.0, 0.5, 0.3, 0.15)
REALTIME_LEAD_S = 0.5  # with realtime: how far ahead of real time chunks may be delivered


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


@lru_cache(maxsize=32)
def _cached_signal(text: str, total: int) -> np.ndarray:
    return render_test_signal(text, 0, total)


@dataclass
class _Stream:
    text: str
    total: int
    channel: ChunkChannel
    position: int = 0
    started_at: float | None = None


_STOP = object()


class InstantEngine(SpeechEngine):
    name = "instant"

    def __init__(self, voices: Sequence[str] = ("en", "zh"), default_voice: str = "en",
                 ms_per_char: float = 60.0, min_duration_s: float = 0.5, max_duration_s: float = 30.0,
                 chunk_ms: int = 200, first_chunk_delay_ms: float = 0.0, realtime: bool = False,
                 graphs: str = "compiled") -> None:
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
        # Like a streaming model: chunks no earlier than REALTIME_LEAD_S ahead of real time, so a stream lasts
        # (and holds its engine slot) about as long as its audio, instead of being done in milliseconds.
        self._realtime = realtime
        # What its health says of compiled graphs (engines.base.GraphsState): it compiles nothing, but it stands in
        # for a GPU engine in tests and benches, e.g. one whose worker compiles after ready.
        if graphs not in GRAPHS_STATES:
            raise ValueError(f"engine.instant.graphs: {graphs!r}; one of {', '.join(GRAPHS_STATES)}")
        self._graphs = graphs
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._worker: threading.Thread | None = None

    def voices(self) -> Sequence[str]:
        return self._voices

    def model_identity(self, voice: str) -> str:
        # the signal depends on the text and these lengths only; "1" is render_test_signal's version
        return f"instant:1:{self._ms_per_char}:{self._min_s}:{self._max_s}"

    @property
    def default_voice(self) -> str:
        return self._default_voice

    def health(self) -> EngineHealth:
        if self._worker is None:
            return EngineHealth("down", reason="not started")
        if not self._worker.is_alive():
            return EngineHealth("down", reason="synthesis thread died")
        return EngineHealth("ready", queue_depth=self._inbox.qsize(), graphs=self._graphs)  # type: ignore[arg-type]

    async def restart(self) -> None:
        if self._worker is not None and self._worker.is_alive():
            await self.close()
        self._worker = None
        self._inbox = queue.SimpleQueue()
        await self.start()

    async def start(self) -> None:
        self._worker = threading.Thread(target=self._serve, name="instant-synth", daemon=True)
        self._worker.start()

    async def close(self) -> None:
        if self._worker is not None:
            self._inbox.put(_STOP)
            await asyncio.to_thread(self._worker.join)
            self._worker = None

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        if self._worker is None:
            raise RuntimeError("instant engine is not running; call start() first")
        if request.segments:
            return speak_segments(self, request)
        channel = ChunkChannel()
        self.streams_opened += 1
        seconds = signal_seconds(request.text, self._ms_per_char, self._min_s, self._max_s)

        def submit() -> None:
            if self._worker is None:  # the engine closed while the first-chunk delay ran
                channel.fail(SynthesisFailed("instant engine closed"))
            else:
                self._inbox.put(_Stream(request.text, int(seconds * SAMPLE_RATE), channel))

        if self._first_chunk_delay_s > 0:
            asyncio.get_running_loop().call_later(self._first_chunk_delay_s, submit)
        else:
            submit()
        return channel

    def _due_at(self, stream: _Stream) -> float:
        if not self._realtime or stream.started_at is None:
            return 0.0
        return stream.started_at + stream.position / SAMPLE_RATE - REALTIME_LEAD_S

    def _idle_wait(self, streams: deque[_Stream]) -> float | None:
        """None: nothing to do until a stream comes; 0: a chunk is due; else seconds until the next is."""
        if not streams:
            return None
        return max(0.0, min(self._due_at(stream) for stream in streams) - time.monotonic())

    def _serve(self) -> None:
        streams: deque[_Stream] = deque()
        while True:
            # block only when idle (or, realtime, until the next chunk is due); take newcomers, then serve one turn
            while True:
                wait = self._idle_wait(streams)
                try:
                    item = self._inbox.get(block=wait != 0, timeout=wait)
                except queue.Empty:
                    break
                if item is _STOP:
                    for stream in streams:
                        stream.channel.fail(SynthesisFailed("instant engine closed"))
                    return
                streams.append(item)
            now = time.monotonic()
            while self._due_at(streams[0]) > now:  # some stream is due (the wait above ran out): rotate to it
                streams.rotate(-1)
            stream = streams.popleft()
            if stream.started_at is None:
                stream.started_at = now
            if stream.channel.cancelled:
                continue
            end = min(stream.position + self._chunk_samples, stream.total)
            try:
                chunk = _cached_signal(stream.text, stream.total)[stream.position:end].copy()
            except Exception as exc:  # one request's failure ends its stream, never the thread
                stream.channel.fail(SynthesisFailed(f"instant: {exc!r}"))
                continue
            stream.channel.put(chunk)
            stream.position = end
            if end < stream.total:
                streams.append(stream)
            else:
                stream.channel.finish()
