"""SpokenTextStream: text arriving in pieces over a WebSocket, spoken sentence by sentence, in order.

Both WebSocket APIs (jambonz's and our bot API) are this one idea: the client pushes text as an LLM produces
it, the `SentenceSplitter` hands out each sentence once its end is certain (or on flush), and one speaker task
speaks the queued sentences one at a time, relaying each one's audio to the client as the engine makes it.
The engine runs faster than real time, so speaking one sentence at a time leaves no gap a listener hears: the
client holds the earlier sentences' audio while the next one's first chunk is made.

`clear()` is barge-in: it cancels the speaker task (which cancels the engine stream it is relaying), drops the
queued sentences and the unsent text, and returns only once the task has stopped, so nothing sent after it
returns belongs to the cleared speech. The handler acknowledges then. Where the audio and messages go is the
handler's: it passes a `SpeechSink`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import structlog

from engine_service.api.audio_format import AudioEncoder, AudioFormat
from engine_service.api.client_pace import SlowClient, relay
from engine_service.api.context import TtsApi
from engine_service.api.errors import ApiError
from engine_service.api.sentences import SentenceSplitter
from engine_service.api.speech import encoded_audio, speech_stream
from engines.base import SynthesisFailed

log = structlog.get_logger(__name__)

_QUEUED_TEXTS = 10  # unspoken text a socket may queue, in max_text_chars: a long LLM reply fits, a flood does not


@dataclass(frozen=True)
class Sentence:
    index: int
    text: str


class SpeechSink(Protocol):
    async def audio(self, sentence: Sentence, data: bytes) -> None: ...

    async def sentence_end(self, sentence: Sentence, audio_bytes: int) -> None: ...

    async def error(self, error: ApiError, sentence: Sentence | None) -> None: ...

    def cut(self) -> None:
        """Drop the connection at once: the client does not take its audio (client_pace.SlowClient)."""


class SpokenTextStream:
    def __init__(self, api: TtsApi, voice: str, audio_format: AudioFormat, sink: SpeechSink,
                 stream_id: str, options: Mapping[str, str] | None = None) -> None:
        """`options`: engine options every sentence is spoken with (instruct / dialect)."""
        self._api = api
        self._options = dict(options or {})
        self._settings = api.settings
        self._voice = voice
        self._format = audio_format
        self._sink = sink
        self._stream_id = stream_id
        self._splitter = SentenceSplitter()
        self._queue: asyncio.Queue[Sentence] = asyncio.Queue()
        self._queued_chars = 0
        self._next_index = 0
        self._speaker = asyncio.create_task(self._speak_queued())

    async def push(self, text: str) -> None:
        limit = self._settings.max_text_chars
        if len(self._splitter.pending) + len(text) > limit:
            self._splitter.clear()
            raise ApiError(413, "text_too_long", f"more than {limit} characters without a sentence end or "
                           "flush; the unsent text was dropped")
        if self._queued_chars + len(text) > _QUEUED_TEXTS * limit:  # memory: a client cannot queue without end
            raise ApiError(429, "too_much_queued", f"over {_QUEUED_TEXTS * limit} characters wait to be "
                           "spoken; this text was dropped")
        for sentence in self._splitter.push(text):
            self._enqueue(sentence)

    def flush(self) -> None:
        if (rest := self._splitter.flush()) is not None:
            self._enqueue(rest)

    async def clear(self) -> None:
        self._splitter.clear()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queued_chars = 0
        await self._stop_speaker()
        self._speaker = asyncio.create_task(self._speak_queued())

    async def close(self) -> None:
        self._splitter.clear()
        await self._stop_speaker()

    async def _stop_speaker(self) -> None:
        self._speaker.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._speaker

    def _enqueue(self, text: str) -> None:
        self._queued_chars += len(text)
        self._queue.put_nowait(Sentence(self._next_index, text))
        self._next_index += 1

    async def _speak_queued(self) -> None:
        while True:
            sentence = await self._queue.get()
            self._queued_chars -= len(sentence.text)
            try:
                await self._speak(sentence)
            except ApiError as error:
                await self._sink.error(error, sentence)
            except SynthesisFailed as failure:
                await self._sink.error(ApiError(500, "synthesis_failed", str(failure)), sentence)
            except ConnectionError:  # the client went away; its handler closes the stream
                return
            except SlowClient as slow:
                self._api.buffers.slow_clients += 1
                log.warning("tts_api_slow_client", stream_id=self._stream_id, index=sentence.index, problem=str(slow))
                self._sink.cut()
                return

    async def _speak(self, sentence: Sentence) -> None:
        sent = 0
        if any(char.isalnum() for char in sentence.text):  # "..." or a lone quote is nothing to say
            request_id = f"{self._stream_id}-{sentence.index}"
            async with speech_stream(self._api, sentence.text, self._voice, request_id,
                                     options=self._options) as channel:
                encoder = AudioEncoder(self._format, self._api.engine.sample_rate)
                async def write(data: bytes) -> None:
                    await self._sink.audio(sentence, data)

                settings = self._api.settings
                async with aclosing(encoded_audio(channel, encoder)) as audio:
                    sent = await relay(audio, write, settings.slow_client_timeout_s,
                                       settings.max_stream_buffer_bytes, self._api.buffers)
        await self._sink.sentence_end(sentence, sent)
        log.debug("tts_sentence_spoken", stream_id=self._stream_id, index=sentence.index, bytes=sent)
