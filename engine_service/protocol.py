"""The engine streaming protocol, version 3: frames between a gateway and an engine worker, parsed and built.

Pure code: no sockets, no clocks. One WebSocket per gateway<->worker link carries many streams, each named
by an integer id the gateway picks (unique on that link while the stream lives). docs/ENGINE_PROTOCOL.md is
the same description for readers outside Python.

Connect: `GET /v1/engine/stream?version=3` with `Authorization: Bearer <token>`. A missing or wrong token
is answered 401, a version the worker does not speak 400 naming both versions, before any upgrade.
The worker's first frame is `hello`.

Control frames are JSON text frames with a "type":

  gateway -> worker
    open    {stream, text, voice, call_id, options, sample_rate, format, segments, paced}   start synthesis
    cancel  {stream}                                                         stop it; no reply
  worker -> gateway
    hello   {version, engine, voices, default_voice, sample_rate, max_text_chars, formats}
    opened  {stream}                       admitted: audio follows
    refused {stream, reason, message}      before any audio; reason is one of REFUSAL_REASONS
    end     {stream}                       all audio sent
    failed  {stream, message}              broke mid-stream; no more audio for it
    status  {state, slots_total, slots_free, queue_depth, first_audio_ms, opens_seen[, graphs]}   every ~250 ms
            (the heartbeat); `graphs` (compiled, compiling, failed) only on a link opened with `&graphs=1`
    error   {stream|null, message}         a frame the worker could not use; the link stays up

Audio travels in binary frames: a 4-byte big-endian stream id, then mono PCM at the stream's sample rate in
its format (`f32le`: float32 little-endian in [-1, 1]; `s16le`: int16 little-endian). Frames of one stream
arrive in order; a frame for a stream the gateway no longer knows (cancelled) is dropped.
"""

from __future__ import annotations

import json
import struct
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import numpy as np

from engines.base import (GRAPHS_STATES, BadText, EmptyText, EngineUnavailable, NoCapacity, SynthesisRefused,
                          TextTooLong, UnknownVoice)
from speech_audio.g711 import float_to_pcm16

# 2: status gained opens_seen; 3: open gained segments (SSML). Unknown fields are errors here, so an older peer
# could not read the newer frames: the version says so at connect (400 naming both) instead of frames breaking.
VERSION = 3
STREAM_PATH = "/v1/engine/stream"
FORMATS = ("f32le", "s16le")
# Why an open was refused -> the engine interface's refusal, so a worker's refusal gets the SIP answer an
# in-process engine's would (unknown voice 404, too long 413, no capacity 503, ...).
_REFUSAL_CLASSES: dict[str, type[SynthesisRefused]] = {
    "unknown_voice": UnknownVoice, "empty_text": EmptyText, "bad_text": BadText, "too_long": TextTooLong,
    "no_capacity": NoCapacity, "unavailable": EngineUnavailable, "bad_request": SynthesisRefused}
REFUSAL_REASONS = tuple(_REFUSAL_CLASSES)
_AUDIO_HEADER = struct.Struct(">I")
MAX_STREAM_ID = 2**32 - 1

Format = Literal["f32le", "s16le"]


class ProtocolError(ValueError):
    """A frame that is not valid protocol; `stream` is its stream id when one could be read."""

    def __init__(self, message: str, stream: int | None = None) -> None:
        super().__init__(message)
        self.stream = stream


# -- control frames --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Open:
    stream: int
    text: str
    voice: str
    call_id: str = ""
    options: dict[str, Any] = field(default_factory=dict)
    sample_rate: int = 24_000
    format: Format = "f32le"
    segments: list[dict[str, Any]] = field(default_factory=list)  # SSML: engines.ssml.segments.to_wire
    paced: bool = True  # False: the audio is collected whole (SynthesisRequest.paced)
    type: Literal["open"] = "open"


@dataclass(frozen=True)
class Cancel:
    stream: int
    type: Literal["cancel"] = "cancel"


@dataclass(frozen=True)
class Hello:
    version: int
    engine: str
    voices: tuple[str, ...]
    default_voice: str
    sample_rate: int
    max_text_chars: int
    formats: tuple[str, ...] = FORMATS
    type: Literal["hello"] = "hello"


@dataclass(frozen=True)
class Opened:
    stream: int
    type: Literal["opened"] = "opened"


@dataclass(frozen=True)
class Refused:
    stream: int
    reason: str
    message: str = ""
    type: Literal["refused"] = "refused"


@dataclass(frozen=True)
class End:
    stream: int
    type: Literal["end"] = "end"


@dataclass(frozen=True)
class Failed:
    stream: int
    message: str = ""
    type: Literal["failed"] = "failed"


@dataclass(frozen=True)
class Status:
    state: Literal["ready", "warming", "down"]
    slots_total: int
    slots_free: int
    queue_depth: int = 0  # streams admitted and still waiting for their first audio
    first_audio_ms: float = 0.0  # the worker's estimate for a stream opened now
    # This link's `open` frames the worker has handled (counted in slots_free, or refused), so a gateway subtracts
    # only its opens still on the way. Required on the wire; the default serves statuses that are not per link.
    opens_seen: int = 0
    # Whether the engine's compiled graphs are in (engines.base.GraphsState). Optional: sent only to a gateway
    # that asked at connect (`graphs=1` in the query), since an older gateway refuses unknown fields; None: not
    # said (an older worker, or a link that did not ask).
    graphs: str | None = None
    type: Literal["status"] = "status"


@dataclass(frozen=True)
class Error:
    stream: int | None
    message: str
    type: Literal["error"] = "error"


Frame = Open | Cancel | Hello | Opened | Refused | End | Failed | Status | Error

# type -> (class, {field: accepted python types}) for every required and optional field
_INT = (int,)
_STR = (str,)
_SCHEMA: dict[str, tuple[type, dict[str, tuple[type, ...]], tuple[str, ...]]] = {
    # type: (class, field types, required fields)
    "open": (Open, {"stream": _INT, "text": _STR, "voice": _STR, "call_id": _STR, "options": (dict,),
                    "sample_rate": _INT, "format": _STR, "segments": (list,),
                    "paced": (bool,)}, ("stream", "text", "voice")),
    "cancel": (Cancel, {"stream": _INT}, ("stream",)),
    "hello": (Hello, {"version": _INT, "engine": _STR, "voices": (list,), "default_voice": _STR,
                      "sample_rate": _INT, "max_text_chars": _INT, "formats": (list,)},
              ("version", "engine", "voices", "default_voice", "sample_rate", "max_text_chars")),
    "opened": (Opened, {"stream": _INT}, ("stream",)),
    "refused": (Refused, {"stream": _INT, "reason": _STR, "message": _STR}, ("stream", "reason")),
    "end": (End, {"stream": _INT}, ("stream",)),
    "failed": (Failed, {"stream": _INT, "message": _STR}, ("stream",)),
    "status": (Status, {"state": _STR, "slots_total": _INT, "slots_free": _INT, "queue_depth": _INT,
                        "first_audio_ms": (int, float), "opens_seen": _INT, "graphs": _STR},
               ("state", "slots_total", "slots_free", "opens_seen")),
    "error": (Error, {"stream": (int, type(None)), "message": _STR}, ("stream", "message")),
}


def serialize(frame: Frame) -> str:
    """One control frame as compact JSON (keys in field order, non-ASCII kept as UTF-8)."""
    data = asdict(frame)
    if isinstance(frame, Open) and not frame.segments:  # plain text: the open reads as it always did
        del data["segments"]
    if isinstance(frame, Status) and frame.graphs is None:  # not asked for: the status reads as it always did
        del data["graphs"]
    if isinstance(frame, Open) and frame.paced:  # sent only when false, so a worker before it reads every live open
        del data["paced"]
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def parse(text: str | bytes) -> Frame:
    """A control frame from a text frame's payload; ProtocolError names the problem (and the stream if known)."""
    try:
        data = json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"frame is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("frame must be a JSON object")
    stream = data.get("stream") if _is_int(data.get("stream")) else None
    kind = data.get("type")
    if kind not in _SCHEMA:
        raise ProtocolError(f"unknown frame type {kind!r}; known: {', '.join(_SCHEMA)}", stream)
    cls, types, required = _SCHEMA[kind]
    values = {key: value for key, value in data.items() if key != "type"}
    unknown = sorted(set(values) - set(types))
    if unknown:
        raise ProtocolError(f"{kind}: unknown field(s) {', '.join(unknown)}", stream)
    missing = [key for key in required if key not in values]
    if missing:
        raise ProtocolError(f"{kind}: missing field(s) {', '.join(missing)}", stream)
    for key, value in values.items():
        if not isinstance(value, types[key]) or (isinstance(value, bool) and bool not in types[key]):
            raise ProtocolError(f"{kind}.{key}: expected {'/'.join(t.__name__ for t in types[key])}, "
                                f"got {type(value).__name__}", stream)
    if "stream" in values and values["stream"] is not None and not 0 <= values["stream"] <= MAX_STREAM_ID:
        raise ProtocolError(f"{kind}.stream: must be 0..{MAX_STREAM_ID}", None)
    if kind == "open":
        if values.get("format", "f32le") not in FORMATS:
            raise ProtocolError(f"open.format: {values['format']!r}; choose one of {', '.join(FORMATS)}", stream)
        if values.get("sample_rate", 24_000) <= 0:
            raise ProtocolError("open.sample_rate: must be positive", stream)
    if kind == "refused" and values["reason"] not in REFUSAL_REASONS:
        raise ProtocolError(f"refused.reason: {values['reason']!r}; known: {', '.join(REFUSAL_REASONS)}", stream)
    if kind == "status" and values["state"] not in ("ready", "warming", "down"):
        raise ProtocolError(f"status.state: {values['state']!r}; one of ready, warming, down", stream)
    if kind == "status" and values.get("graphs", "compiled") not in GRAPHS_STATES:
        raise ProtocolError(f"status.graphs: {values['graphs']!r}; one of {', '.join(GRAPHS_STATES)}", stream)
    if kind == "hello":
        values["voices"] = tuple(values["voices"])
        values["formats"] = tuple(values.get("formats", FORMATS))
    return cls(**values)


def refusal_reason(refusal: SynthesisRefused) -> str:
    """The wire reason for an engine's refusal (the most specific class that matches)."""
    # bad_request (the base class) comes last, so a subclass finds its own reason first
    return next(reason for reason, cls in _REFUSAL_CLASSES.items() if isinstance(refusal, cls))


def refusal_error(frame: Refused) -> SynthesisRefused:
    """The engine interface's refusal for a `refused` frame, so the gateway answers the same SIP code as in-process."""
    return _REFUSAL_CLASSES[frame.reason](frame.message or frame.reason)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- audio frames ----------------------------------------------------------------------------------
def encode_audio(stream: int, samples: np.ndarray, fmt: Format) -> bytes:
    """A binary frame: stream id, then the float32 samples in `fmt` (s16le clips to the int16 range)."""
    if fmt == "f32le":
        pcm = np.asarray(samples, dtype="<f4").tobytes()
    else:
        pcm = float_to_pcm16(np.asarray(samples, dtype=np.float32)).astype("<i2").tobytes()
    return _AUDIO_HEADER.pack(stream) + pcm


def decode_audio(frame: bytes, fmt_of: dict[int, Format]) -> tuple[int, np.ndarray]:
    """(stream id, float32 samples) of a binary frame; `fmt_of` gives each live stream's format.
    A stream not in `fmt_of` yields an empty array (cancelled: its late audio is dropped)."""
    if len(frame) < _AUDIO_HEADER.size:
        raise ProtocolError(f"audio frame of {len(frame)} bytes is shorter than its {_AUDIO_HEADER.size}-byte header")
    (stream,) = _AUDIO_HEADER.unpack_from(frame)
    fmt = fmt_of.get(stream)
    if fmt is None:
        return stream, np.zeros(0, dtype=np.float32)
    width = 4 if fmt == "f32le" else 2
    if (len(frame) - _AUDIO_HEADER.size) % width:
        raise ProtocolError(f"audio frame for stream {stream}: {len(frame) - 4} bytes is not whole {fmt} samples",
                            stream)
    if fmt == "f32le":
        return stream, np.frombuffer(frame, dtype="<f4", offset=_AUDIO_HEADER.size).astype(np.float32)
    return stream, np.frombuffer(frame, dtype="<i2", offset=_AUDIO_HEADER.size).astype(np.float32) / 32768.0
