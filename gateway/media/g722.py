"""G.722 (ITU-T G.722, 64 kbit/s SB-ADPCM) for wideband calls, from the `G722` package (sippy/libg722: Steve
Underwood's bit-exact codec, the one Asterisk and FreeSWITCH also carry) rather than our own DSP.

Unlike G.711, G.722 is an adaptive coder: each direction of a call needs its own encoder (or decoder) state,
kept for the whole call, so a frame encodes differently depending on the frames before it. 16 kHz int16 in, 4
bits per sample out: a 20 ms frame of 320 samples is 160 bytes. The RTP clock is 8000 although the audio is
16 kHz (RFC 3551 §4.5.2, a mistake kept for compatibility): gateway/media/codecs.py owns that quirk.
"""

from __future__ import annotations

import G722
import numpy as np

SAMPLE_RATE = 16000
BIT_RATE = 64000  # mode 1, the only one RTP payload type 9 carries (RFC 3551 §4.5.2)


class G722Encoder:
    """One call's sending direction: 16 kHz int16 frames in, G.722 bytes out, state carried across frames."""

    def __init__(self) -> None:
        self._codec = G722.G722(SAMPLE_RATE, BIT_RATE)

    def encode(self, pcm16: np.ndarray) -> bytes:
        # The package reads any buffer of C shorts: a contiguous int16 array is passed without a copy.
        return self._codec.encode(np.ascontiguousarray(pcm16, dtype=np.int16))


class G722Decoder:
    """One receiving direction (the test phone, tests): G.722 bytes in, 16 kHz int16 out."""

    def __init__(self) -> None:
        self._codec = G722.G722(SAMPLE_RATE, BIT_RATE, use_numpy=False)

    def decode(self, payload: bytes) -> np.ndarray:
        return np.frombuffer(self._codec.decode(payload), dtype=np.int16).copy()
