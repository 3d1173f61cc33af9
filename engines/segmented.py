"""Speaking SSML segments on any engine: each `Speech` as one plain stream of that engine, in order, with each
`Pause` as real silence (zeros at the engine's rate) between them, and `volume_db` as a gain on the samples.

One `ChunkChannel` comes back, as for plain text, so the gateway and the speech API read an SSML request exactly
as any other. The whole stream is admitted when its first speech stream is (a document that starts with a pause
is admitted at once): a refusal of the first piece is still a refusal before the call is answered. A later piece
the engine cannot take ends the stream with SynthesisFailed, as a failing engine does. Cancelling the channel
cancels the piece being spoken. Runs on the event loop; the engine's own threads do the synthesis.

Rate: an engine that can change its pace says so with `honours_rate` and gets the segment's rate as the
request option `rate`; the others speak at their own pace (README "SSML" says which).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from engines.base import SynthesisFailed, SynthesisRefused, SynthesisRequest
from engines.channel import ChunkChannel
from engines.ssml import AudioResolver, is_ssml, parse_ssml, spoken_text
from engines.ssml.segments import Pause, Speech

if TYPE_CHECKING:
    from engines.base import SpeechEngine

_SILENCE_CHUNK_MS = 100  # a pause is handed over in pieces this long, like speech, so playout starts as usual


class _SegmentedChannel(ChunkChannel):
    def __init__(self) -> None:
        super().__init__(admitted=False)
        self.piece: ChunkChannel | None = None
        self.task: asyncio.Task[None] | None = None
        self.settled = False  # admit()/refuse() only post to the loop: remember which was said

    def admit(self) -> None:
        if not self.settled:
            self.settled = True
            super().admit()

    def cancel(self) -> None:
        if self.piece is not None:
            self.piece.cancel()
        if self.task is not None:
            self.task.cancel()
        super().cancel()


def speech_request(text: str, voice: str, *, call_id: str = "", options: Mapping[str, Any] | None = None,
                   ssml: bool | None = None, audio: AudioResolver | None = None) -> SynthesisRequest:
    """The request for `text`, read as SSML when `ssml` is True, or when it is None and the text starts with
    `<speak` (jambonz's rule); raises SsmlError. Every way in (SIP, routes, the speech API) builds it here."""
    options = MappingProxyType(dict(options or {}))
    if ssml is False or (ssml is None and not is_ssml(text)):
        return SynthesisRequest(text=text, voice=voice, call_id=call_id, options=options)
    segments = parse_ssml(text, audio)
    return SynthesisRequest(text=spoken_text(segments), voice=voice, call_id=call_id, options=options,
                            segments=segments)


def speak_segments(engine: SpeechEngine, request: SynthesisRequest) -> ChunkChannel:
    """The request's segments spoken in order on `engine` (whose `open_stream` takes the plain pieces)."""
    channel = _SegmentedChannel()
    channel.task = asyncio.get_running_loop().create_task(_run(engine, request, channel),
                                                          name=f"segments-{request.call_id}")
    return channel


def _piece_request(engine: SpeechEngine, request: SynthesisRequest, speech: Speech) -> SynthesisRequest:
    options = dict(request.options)
    if speech.rate != 1.0 and engine.honours_rate:
        options["rate"] = speech.rate
    return replace(request, text=speech.text, segments=(), options=MappingProxyType(options))


async def _run(engine: SpeechEngine, request: SynthesisRequest, out: _SegmentedChannel) -> None:
    rate = engine.sample_rate
    try:
        for segment in request.segments:
            if isinstance(segment, Pause):
                out.admit()
                samples = segment.ms * rate // 1000
                step = _SILENCE_CHUNK_MS * rate // 1000
                for start in range(0, samples, step):
                    out.put(np.zeros(min(step, samples - start), dtype=np.float32))
                continue
            piece = engine.open_stream(_piece_request(engine, request, segment))
            out.piece = piece
            try:
                await piece.admitted()
            except SynthesisRefused as exc:
                if out.settled:
                    raise SynthesisFailed(f"segment {segment.text[:40]!r} refused mid-stream: {exc}") from exc
                out.refuse(exc)
                return
            out.admit()
            gain = 10 ** (segment.volume_db / 20)
            async for chunk in piece:
                out.put(np.clip(chunk * gain, -1.0, 1.0) if gain != 1.0 else chunk)
            out.piece = None
        out.admit()
        out.finish()
    except asyncio.CancelledError:
        if out.piece is not None:
            out.piece.cancel()
        raise
    except SynthesisRefused as exc:  # engine.open_stream refused at once
        if out.settled:
            out.fail(SynthesisFailed(str(exc)))
        else:
            out.refuse(exc)
    except Exception as exc:  # noqa: BLE001 - the piece's failure is this stream's, never the loop's
        out.fail(exc if isinstance(exc, SynthesisFailed) else SynthesisFailed(repr(exc)))
