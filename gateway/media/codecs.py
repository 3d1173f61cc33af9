"""The audio codecs a call may use: payload type, rates and a per-call frame encoder for each.

G.711 (PCMU, PCMA) carries 8 kHz audio; G.722 carries 16 kHz audio but keeps an 8000 Hz RTP clock and says
8000 in SDP (RFC 3551 §4.5.2), so on our one 20 ms packet clock every codec advances the RTP timestamp by 160
per packet while a G.722 frame holds 320 samples. Pure: no sockets, no clocks.

Opus is not here: no well-kept Python binding exists (opuslib's last release is from 2018, PyOgg's from 2022 and
aimed at files), and G.722 already gives the wideband PBXs and desk phones offer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from speech_audio import g711
from gateway.media.g722 import G722Encoder

PACKET_MS = 20
RTP_CLOCK_RATE = 8000  # every codec here, G.722 included (RFC 3551 §4.5.2)


@dataclass(frozen=True)
class Codec:
    name: str  # the SDP encoding name, upper-cased
    payload_type: int  # static (RFC 3551 §6, table 4)
    audio_rate: int  # samples per second of the audio it carries

    @property
    def frame_samples(self) -> int:
        """Samples of audio in one 20 ms packet."""
        return self.audio_rate * PACKET_MS // 1000


CODECS: dict[str, Codec] = {"PCMU": Codec("PCMU", 0, 8000), "PCMA": Codec("PCMA", 8, 8000),
                            "G722": Codec("G722", 9, 16000)}

FrameEncoder = Callable[[np.ndarray], bytes]


def frame_encoder(name: str) -> FrameEncoder:
    """A new encoder for one call's sending direction (G.722 keeps state, so never share one between calls)."""
    if name == "G722":
        return G722Encoder().encode
    return partial(g711.encode, codec=name)
