"""The audio the API sends: which formats and rates exist, and the streaming encoder for one response.

An engine hands out float32 mono chunks at its own rate (24 kHz); a response wants wav, raw 16-bit PCM, or
G.711 at 8, 16 or 24 kHz. `AudioEncoder` turns chunks into bytes as they arrive: it resamples with
speech_audio/resample.py, the gateway's streaming python-soxr resampler (filter state carried across chunks, so
no clicks at the seams; quality HQ delays the audio ~17 ms, against ~60 ms for VHQ, and first audio is what a
caller waits for), converts to int16 and, for G.711, companders. A wav stream starts with a header whose sizes say
"unknown length" (0xFFFFFFFF), what ffmpeg writes to a pipe: ffmpeg, sox and Python's wave read to the end of the stream
(tested), though a tool that prints the header's size (soxi) reports 37 hours at 16 kHz. A size of 0, the other
convention, makes sox read nothing and Python's wave refuse the file.

`audio/l16` is, strictly (RFC 2586), big-endian; jambonz and most TTS vendors use it for little-endian PCM,
and so do we, because jambonz is the client that reads it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from speech_audio import g711
from speech_audio.resample import Resampler

FORMATS = ("wav", "pcm_s16le", "pcmu", "pcma")
SAMPLE_RATES = (8000, 16000, 24000)
_G711 = ("pcmu", "pcma")
_UNKNOWN_LENGTH = 0xFFFFFFFF


class FormatProblem(ValueError):
    """A format/rate pair the API cannot produce; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class AudioFormat:
    name: str
    sample_rate: int

    @classmethod
    def parse(cls, name: str | None, sample_rate: int | None, default_rate: int = 24000) -> AudioFormat:
        """Validate a request's format and rate; G.711 defaults to (and only exists at) 8 kHz."""
        name = name or "wav"
        if name not in FORMATS:
            raise FormatProblem("format", f"unknown format {name!r}; choose one of {', '.join(FORMATS)}")
        if sample_rate is None:
            sample_rate = 8000 if name in _G711 else default_rate
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, int) or sample_rate not in SAMPLE_RATES:
            raise FormatProblem("sample_rate", f"sample_rate must be one of {', '.join(map(str, SAMPLE_RATES))}")
        if name in _G711 and sample_rate != 8000:
            raise FormatProblem("sample_rate", f"{name} is defined at 8000 Hz only")
        return cls(name, sample_rate)

    @property
    def content_type(self) -> str:
        if self.name == "wav":
            return "audio/wav"
        if self.name == "pcm_s16le":
            return f"audio/l16;rate={self.sample_rate}"
        return f"audio/{self.name.upper()};rate={self.sample_rate}"  # RFC 4856 audio/PCMU, audio/PCMA

    @property
    def bytes_per_sample(self) -> int:
        return 1 if self.name in _G711 else 2


# WAVE format tags (RFC 2361): 16-bit PCM, and G.711 A-law and u-law at 8 bits a sample.
_WAV_CODECS = {"pcm16": (1, 16), "pcma": (6, 8), "pcmu": (7, 8)}


def wav_header(sample_rate: int, codec: str = "pcm16", data_bytes: int | None = None) -> bytes:
    """RIFF/WAVE header for mono `codec` audio; with `data_bytes` None, of unknown length (0xFFFFFFFF sizes).

    G.711 gets the 18-byte fmt chunk and the fact chunk (sample count) that non-PCM WAVE requires; players
    that only know PCM WAV (Asterisk's format_wav) need codec pcm16."""
    tag, bits = _WAV_CODECS[codec]
    width = bits // 8
    fmt = struct.pack("<HHIIHH", tag, 1, sample_rate, sample_rate * width, width, bits)
    fact = b""
    if tag != 1:
        fmt += struct.pack("<H", 0)
        if data_bytes is not None:
            fact = b"fact" + struct.pack("<II", 4, data_bytes // width)
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt + fact
    riff_size = _UNKNOWN_LENGTH if data_bytes is None else 4 + len(chunks) + 8 + data_bytes
    data_size = _UNKNOWN_LENGTH if data_bytes is None else data_bytes
    return b"RIFF" + struct.pack("<I", riff_size) + b"WAVE" + chunks + b"data" + struct.pack("<I", data_size)


class AudioEncoder:
    """One response's engine chunks -> bytes of `audio_format`. Call `encode` per chunk, `finish` once."""

    def __init__(self, audio_format: AudioFormat, source_rate: int) -> None:
        self.format = audio_format
        self._resampler = Resampler(source_rate, audio_format.sample_rate)  # HQ, as the gateway's line audio
        self._header_due = audio_format.name == "wav"

    def encode(self, chunk: np.ndarray) -> bytes:
        return self._bytes(self._resampler.push(chunk))

    def finish(self) -> bytes:
        """The resampler's tail (and the wav header, if no chunk came at all)."""
        return self._bytes(self._resampler.flush())

    def _bytes(self, samples: np.ndarray) -> bytes:
        header = b""
        if self._header_due:
            header, self._header_due = wav_header(self.format.sample_rate), False
        linear = g711.float_to_pcm16(samples)
        if self.format.name in _G711:
            return header + g711.encode(linear, self.format.name.upper())
        return header + linear.astype("<i2").tobytes()
