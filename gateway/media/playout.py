"""The playout buffer: audio at the codec's rate in at the engine's bursty pace, one 20 ms frame out per tick
(160 samples at G.711's 8 kHz, 320 at G.722's 16 kHz).

Audio is stored as 16-bit PCM, the input the codecs encode: converting float32 once per chunk instead of
once per frame takes the float scaling, rounding and clipping off the per-tick hot path (measured in
bench/bench_media_tick.py: 18 us -> 2.5 us per frame encode on the CI box).

A prompt does not start until enough audio is buffered to ride out the engine's jitter. The start
threshold is learnt from the chunk arrivals: the largest net drain over any stretch of the stream
(time elapsed between two arrivals minus the audio the chunks in between carried) is how much audio
playback would have consumed with nothing new arriving; buffering that much up front avoids the gap.
An engine slower than real time drains without limit, so its threshold climbs to the cap. It is bounded by [min_delay_ms, max_delay_ms]; before anything is learnt, `initial_delay_ms` applies.
A stream that has ended starts at once, whatever is buffered.

Once playing, each tick takes one frame. An empty buffer mid-prompt is an underrun: that slot is
silence (zeros, never stale audio), it is counted, and the buffer goes back to buffering with its floor
raised by `underrun_step_ms`, so a jittery engine pays for one glitch, not one per chunk. Each silent slot
counts in `underruns`; `underrun_events` counts the times playback ran dry, and `first_underrun_s` says how
much of its prompt had played when that first happened (a first chunk too short for the next to follow shows
as a first underrun at its length). No clocks: the caller passes arrival times in.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from gateway import metrics
from speech_audio.g711 import float_to_pcm16

FRAME_MS = 20  # RFC 3551 §4.5: the default packetisation of G.711 and G.722


@dataclass(frozen=True)
class PlayoutSettings:
    initial_delay_ms: int = 60
    min_delay_ms: int = 20
    max_delay_ms: int = 400
    underrun_step_ms: int = 40


class PlayoutState(enum.Enum):
    IDLE = "idle"  # no prompt: nothing to send
    BUFFERING = "buffering"  # prompt started (or underran), waiting for the start threshold
    PLAYING = "playing"


class PlayoutBuffer:
    def __init__(self, settings: PlayoutSettings = PlayoutSettings(), sample_rate: int = 8000) -> None:
        self.settings = settings
        self.sample_rate = sample_rate
        self.frame_samples = sample_rate * FRAME_MS // 1000
        self.underruns = 0  # silent slots, every prompt of the call
        self.underrun_events = 0  # times playback ran dry
        self.first_underrun_s: float | None = None  # seconds of its prompt played before the first ran dry
        self.state = PlayoutState.IDLE
        self._floor = self._samples(settings.initial_delay_ms)
        self._max_drain = 0  # samples; learnt across prompts: the engine's jitter outlives one prompt
        self._buffer = np.zeros(0, dtype=np.int16)
        self._read = 0
        self._ended = False
        self._started = False  # played at least one frame of this prompt
        self._drain_origin: float | None = None  # min over arrivals of (arrival time - audio before it)
        self._received = 0  # samples of this prompt received so far
        self._played = 0  # samples of this prompt handed out so far

    def _samples(self, ms: float) -> int:
        return int(ms * self.sample_rate / 1000)

    @property
    def buffered(self) -> int:
        """Samples waiting to be played."""
        return self._buffer.size - self._read

    @property
    def start_threshold(self) -> int:
        """Samples that must be buffered before playback (re)starts."""
        low, high = self._samples(self.settings.min_delay_ms), self._samples(self.settings.max_delay_ms)
        return min(high, max(low, self._floor, self._max_drain))

    @property
    def finished(self) -> bool:
        """The prompt's stream has ended and its last sample has been handed out."""
        return self._ended and self.buffered == 0 and self.state is PlayoutState.IDLE

    @property
    def starting(self) -> bool:
        """The prompt may play and none of it has been handed out yet: its first frame is ready now."""
        return self.state is PlayoutState.PLAYING and not self._started

    def begin_prompt(self) -> None:
        self.flush()
        self.state = PlayoutState.BUFFERING

    def push(self, samples: np.ndarray, now: float) -> None:
        """Append audio at `sample_rate` (float32 in [-1, 1) or int16) that arrived at `now` (seconds, monotonic)."""
        if self.state is PlayoutState.IDLE:
            self.begin_prompt()
        self._learn_jitter(now)
        self._received += samples.size
        if samples.size:
            pcm = samples if samples.dtype == np.int16 else float_to_pcm16(samples)
            # Nothing left to play: keep the chunk itself. A cache hit is one array shared by every call playing
            # that prompt (read only here), so a thousand hits of a 30-s prompt hold one copy, not 480 MB.
            self._buffer = pcm if self.buffered == 0 else np.concatenate((self._buffer[self._read :], pcm))
            self._read = 0
        self._maybe_start()

    def end_of_stream(self) -> None:
        self._ended = True
        if self.buffered == 0:  # nothing left (or an empty prompt): done without another packet
            self.state = PlayoutState.IDLE
        self._maybe_start()

    def pop_frame(self) -> np.ndarray | None:
        """The next frame of int16 samples, or None while nothing is to be sent (idle, or buffering a prompt's start)."""
        if self.state is PlayoutState.PLAYING:
            available = self.buffered
            size = self.frame_samples
            if available >= size:
                frame = self._buffer[self._read : self._read + size]
                self._read += size
            elif self._ended:  # the last, partial frame: pad with silence
                frame = np.zeros(size, dtype=np.int16)
                frame[:available] = self._buffer[self._read :]
                self._read += available
            else:
                return self._underrun()
            if self._ended and self.buffered == 0:
                self.state = PlayoutState.IDLE
            self._started = True
            self._played += min(size, available)
            return frame
        if self.state is PlayoutState.BUFFERING and self._started:
            return self._underrun()  # still refilling after an underrun: keep the slot, send silence
        return None

    def flush(self) -> None:
        """Discard everything (hang-up, barge-in); the learnt jitter is kept for the next prompt."""
        self._buffer = np.zeros(0, dtype=np.int16)
        self._read = 0
        self._ended = False
        self._started = False
        self._drain_origin = None
        self._received = 0
        self._played = 0
        self.state = PlayoutState.IDLE

    def _underrun(self) -> np.ndarray:
        self.underruns += 1
        metrics.playout_underruns_total.inc()
        if self.state is PlayoutState.PLAYING:
            self.underrun_events += 1
            if self.first_underrun_s is None:
                self.first_underrun_s = self._played / self.sample_rate
            self.state = PlayoutState.BUFFERING
            self._floor = min(self._samples(self.settings.max_delay_ms),
                              self.start_threshold + self._samples(self.settings.underrun_step_ms))
        return np.zeros(self.frame_samples, dtype=np.int16)

    def _learn_jitter(self, now: float) -> None:
        # D_j = t_j - A_j (arrival time minus audio received before it, in seconds); the worst drain
        # between arrivals i < j is D_j - min_{i<=j} D_i.
        deficit = now - self._received / self.sample_rate
        if self._drain_origin is None or deficit < self._drain_origin:
            self._drain_origin = deficit
        drain = self._samples((deficit - self._drain_origin) * 1000)
        self._max_drain = max(self._max_drain, drain)

    def _maybe_start(self) -> None:
        if self.state is PlayoutState.BUFFERING and (self._ended or self.buffered >= self.start_threshold):
            self.state = PlayoutState.PLAYING
