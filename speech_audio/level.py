"""Speech level on the line: dBm0, the active speech level of a recording, and a stream's gain and peak limiter.

The reference is ITU-T G.711's: the digital milliwatt (G.711 Tables 5 and 6, a 1 kHz sine) is 0 dBm0, and a sine
at the coder's full scale is +3.17 dBm0 for mu-law (+3.14 for A-law; the 0.03 dB between them is below anything
this module is asked to hold, so one reference serves both). In the 16-bit linear PCM the coders take, a sine of
RMS `r` (full scale 1.0) is therefore `20 log10(r * sqrt 2) + 3.17` dBm0: -19 dBm0, the telephony target RFC 7874
§4 quotes from ITU-T G.169, is an RMS of about -25.2 dB re full scale.

Active speech level: ITU-T P.56 measures the RMS over the time speech is active, not over the pauses. Here,
simplified: 20 ms frames; a frame is active when its energy is within `P56_MARGIN_DB` (15.9 dB, P.56's margin)
of the active level, found by iterating from the long-term level. A prompt with half its time in pauses thus
gets the same level as the same words said without them, which is what a listener hears.

Gain and limiter: the gain for a voice is measured once (`gain_db_for`) and stays fixed for every stream of it, so
a stream's level never pumps. Whatever that gain does to a loud passage, `LineLevel` keeps every sample at or below
`PEAK_CEILING_DBM0`, the peak of a 0 dBm0 sine (3.17 dB under the coder's overload): the gain drops at once on a
sample that would pass the ceiling and recovers linearly over `RELEASE_S`. No look-ahead, so no added latency.
"""

from __future__ import annotations

import math

import numpy as np

FULL_SCALE_SINE_DBM0 = 3.17  # ITU-T G.711 mu-law: a full-scale sine's level (A-law: 3.14)
DEFAULT_SPEECH_LEVEL_DBM0 = -19.0  # RFC 7874 §4, quoting ITU-T G.169
PEAK_CEILING_DBM0 = 0.0  # no sample beyond the peak of the digital milliwatt
P56_MARGIN_DB = 15.9  # ITU-T P.56: the activity threshold lies this far below the active level
SILENCE_FLOOR_DBM0 = -70.0  # frames quieter than this are never speech (codec idle noise is far lower)
FRAME_S = 0.02
RELEASE_S = 0.05  # the limiter's gain climbs back from 0 to 1 in this long
_SINE_RMS_DB = 20 * math.log10(math.sqrt(0.5))  # a sine's RMS against its peak: -3.01 dB


def dbm0_of_rms(rms: float) -> float:
    """dBm0 of a signal whose RMS is `rms` (full scale 1.0)."""
    return 20 * math.log10(max(rms, 1e-12)) - _SINE_RMS_DB + FULL_SCALE_SINE_DBM0


def rms_of_dbm0(dbm0: float) -> float:
    return 10 ** ((dbm0 - FULL_SCALE_SINE_DBM0 + _SINE_RMS_DB) / 20)


def peak_of_dbm0(dbm0: float) -> float:
    """The peak amplitude (full scale 1.0) of a sine at `dbm0`."""
    return 10 ** ((dbm0 - FULL_SCALE_SINE_DBM0) / 20)


def active_speech_dbm0(samples: np.ndarray, rate: int) -> float | None:
    """P.56-style active level (simplified, see the module doc) of float samples in [-1, 1) or int16; None if
    nothing in it is louder than the silence floor."""
    audio = samples.astype(np.float64) / (32768.0 if samples.dtype == np.int16 else 1.0)
    frame = int(rate * FRAME_S)
    count = audio.size // frame
    if count == 0:
        return None
    energy = np.mean(audio[: count * frame].reshape(count, frame) ** 2, axis=1)
    energy = energy[energy > rms_of_dbm0(SILENCE_FLOOR_DBM0) ** 2]
    if energy.size == 0:
        return None
    level = float(np.mean(energy))
    for _ in range(20):  # converges in a few rounds: the level only rises as quiet frames drop out
        active = energy[energy >= level * 10 ** (-P56_MARGIN_DB / 10)]
        new = float(np.mean(active))
        if abs(10 * math.log10(new / level)) < 0.01:
            break
        level = new
    return dbm0_of_rms(math.sqrt(level))


def gain_db_for(measured_dbm0: float | None, target_dbm0: float | None) -> float:
    """The fixed gain that brings a voice measured at `measured_dbm0` to `target_dbm0` (0 when either is
    unknown: a voice with no measurable speech, or a line left as the engine makes it)."""
    if measured_dbm0 is None or target_dbm0 is None:
        return 0.0
    return target_dbm0 - measured_dbm0


class LineLevel:
    """One stream's fixed gain and peak limiter, applied chunk by chunk with the limiter's state carried over."""

    def __init__(self, gain_db: float, rate: int, ceiling_dbm0: float = PEAK_CEILING_DBM0) -> None:
        self.gain = 10 ** (gain_db / 20)
        self.ceiling = peak_of_dbm0(ceiling_dbm0)
        self._release = 1.0 / (RELEASE_S * rate)  # gain regained per sample
        self._limit = 1.0  # the limiter's gain after the last sample
        self.limited_samples = 0

    def apply(self, chunk: np.ndarray) -> np.ndarray:
        """float32 in -> float32 out, gained, with no sample above the ceiling."""
        out = chunk.astype(np.float64) * self.gain
        if out.size == 0:
            return out.astype(np.float32)
        peak = np.abs(out)
        needed = np.minimum(1.0, self.ceiling / np.maximum(peak, 1e-12))
        if needed.min() >= 1.0 and self._limit >= 1.0:
            return out.astype(np.float32)
        # g[n] = min(needed[n], g[n-1] + release): instant attack, linear release. Unrolled, that is
        # g[n] = n*release + min(g[-1] + release, min_{k<=n}(needed[k] - k*release)), one running minimum.
        steps = np.arange(out.size) * self._release
        running = np.minimum.accumulate(needed - steps)
        limit = np.minimum(running, self._limit + self._release) + steps
        self.limited_samples += int(np.count_nonzero(limit < 1.0))
        self._limit = float(limit[-1])
        # float32 rounding must not lift a limited sample over the ceiling
        return np.clip(out * limit, -self.ceiling, self.ceiling).astype(np.float32)
