"""EspeakEngine: the embedded CPU engine that speaks on a fresh machine with no GPU and no model.

It drives libespeak-ng from the `espeakng-loader` wheel (library and voice data bundled) through
ctypes in synchronous mode: `espeak_Synth` blocks and hands 22050 Hz int16 buffers to a callback as
it produces them; each buffer is resampled to 24 kHz and put on the stream's `ChunkChannel` at once,
so the first chunk leaves long before the utterance is finished.

libespeak-ng keeps its state in process globals and is not thread-safe, so every call into it is
made from one worker thread per engine, under one process-wide lock (two engines in one process,
as in tests, take turns). The library is initialised once per process and never terminated:
`espeak_Terminate` would pull it from under another engine. Nothing here runs on the event loop.

A long prompt must not delay everyone: the worker thread speaks each job a piece at a time (a sentence, or
about `_PIECE_CHARS` of them) and takes the jobs in turn, so a short prompt queued behind five 2,000-character
ones waits for at most one piece of each (espeak speaks a piece in tens of milliseconds, far ahead of
playback), not for their whole texts.

One bad request fails its own stream only: everything a job does is inside one try on the worker thread. The
worker reports when it started its current job, so `health()` can call it stuck (espeak speaks a few hundred
times faster than real time: a job that runs for `stuck_after_s` is hung in C) or dead, and the watchdog
restarts it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import soxr
import structlog

from engines.base import (
    SAMPLE_RATE,
    EngineHealth,
    EngineSettingsError,
    SpeechEngine,
    SynthesisFailed,
    SynthesisRequest,
)
from engines.channel import ChunkChannel
from engines.segmented import speak_segments

log = structlog.get_logger(__name__)

# speak_lib.h constants
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000  # report missing data instead of calling exit()
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE = 1  # espeak_PARAMETER espeakRATE, words per minute
_EE_OK = 0
# Length of each buffer the callback receives. espeak runs a few hundred times faster than real
# time, so this sets the streaming granularity, not latency; 100 ms keeps the chunk count small.
_CALLBACK_MS = 100
# One turn of the worker thread speaks at most this much of a job (whole sentences when they fit): long enough
# that espeak's per-call set-up is noise, short enough that a turn takes tens of milliseconds.
_PIECE_CHARS = 240
_SENTENCE_END = re.compile(r"(?<=[.!?;。！？；\n])")

_SynthCallback = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)

DEFAULT_VOICES: Mapping[str, str] = {"en": "en-us", "zh": "cmn"}


def speaking_pieces(text: str, limit: int = _PIECE_CHARS) -> list[str]:
    """`text` cut at sentence ends into pieces of at most about `limit` characters (a longer sentence is cut
    at a space, else anywhere); joined, the pieces are the text."""
    pieces: list[str] = []
    for sentence in filter(None, _SENTENCE_END.split(text)):
        while len(sentence) > limit:
            cut = sentence.rfind(" ", 0, limit) + 1 or limit
            pieces.append(sentence[:cut])
            sentence = sentence[cut:]
        if pieces and len(pieces[-1]) + len(sentence) <= limit:
            pieces[-1] += sentence
        elif sentence:
            pieces.append(sentence)
    return pieces


@dataclass
class _Job:
    text: str
    espeak_voice: str
    channel: ChunkChannel
    call_id: str = ""
    rate_wpm: int = 175
    pieces: deque[str] = field(default_factory=deque)  # what is left to speak, a turn each
    synthesis: _Synthesis | None = None  # one per job: its resampler runs across the pieces

    def __post_init__(self) -> None:
        if not self.pieces:
            self.pieces.extend(speaking_pieces(self.text))


def _loader_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("espeakng-loader")
    except metadata.PackageNotFoundError:
        return "unknown"


class _Library:
    """The process-wide libespeak-ng: loaded and initialised once, used under `lock` only."""

    _instance: _Library | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        import espeakng_loader  # the wheel that bundles the library and its data

        try:
            lib = ctypes.CDLL(espeakng_loader.get_library_path())
            data_path = espeakng_loader.get_data_path()
        except (OSError, RuntimeError) as exc:
            raise RuntimeError(f"espeak: cannot load libespeak-ng from the espeakng-loader wheel: {exc}") from exc
        lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
        lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.espeak_SetSynthCallback.argtypes = [_SynthCallback]
        lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                     ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
        rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, _CALLBACK_MS, data_path.encode(),
                                     _INITIALIZE_DONT_EXIT)
        if rate <= 0:
            raise RuntimeError(f"espeak: espeak_Initialize failed ({rate}) with data at {data_path}")
        self.lib = lib
        self.native_rate = int(rate)
        self.lock = threading.Lock()
        # One C callback for the process; it forwards to whichever synthesis holds the lock.
        self.on_audio: _Synthesis | None = None
        self._callback = _SynthCallback(self._dispatch)
        lib.espeak_SetSynthCallback(self._callback)

    @classmethod
    def get(cls) -> _Library:
        with cls._instance_lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def _dispatch(self, wav, numsamples: int, _events) -> int:
        target = self.on_audio
        if target is None:
            return 1
        return target.on_audio(wav, numsamples)

    def has_voice(self, espeak_voice: str) -> bool:
        with self.lock:
            return self.lib.espeak_SetVoiceByName(espeak_voice.encode()) == _EE_OK


class _Synthesis:
    """One utterance: native buffers in, 24 kHz float32 chunks out, stop when asked."""

    def __init__(self, channel: ChunkChannel, native_rate: int, stopping: threading.Event) -> None:
        self.channel = channel
        self.stopping = stopping
        self.resampler = soxr.ResampleStream(native_rate, SAMPLE_RATE, 1, dtype="float32")
        self.error: BaseException | None = None

    def on_audio(self, wav, numsamples: int) -> int:
        """The synth callback: returns 1 to make espeak abort the utterance."""
        if self.channel.cancelled or self.stopping.is_set():
            return 1
        if not wav or numsamples <= 0:  # end-of-utterance marker
            return 0
        try:
            native = np.ctypeslib.as_array(wav, shape=(numsamples,)).astype(np.float32) / 32768.0
            chunk = self.resampler.resample_chunk(native)
            if chunk.size:
                self.channel.put(chunk)
        except Exception as exc:  # an exception must not unwind through C; abort and report it
            self.error = exc
            return 1
        return 0

    def flush(self) -> None:
        tail = self.resampler.resample_chunk(np.zeros(0, dtype=np.float32), last=True)
        if tail.size:
            self.channel.put(tail)


class EspeakEngine(SpeechEngine):
    name = "espeak"
    honours_rate = True  # SSML prosody rate scales the words per minute

    def __init__(self, voices: Mapping[str, str] | None = None, default_voice: str = "en",
                 rate_wpm: int = 175, stuck_after_s: float = 10.0) -> None:
        self._voices = dict(voices if voices is not None else DEFAULT_VOICES)
        if not self._voices:
            raise ValueError("engine.espeak.voices: at least one voice is required")
        if default_voice not in self._voices:
            raise ValueError(f"engine.espeak.default_voice: {default_voice!r} is not one of the configured voices")
        self._default_voice = default_voice
        self._rate_wpm = rate_wpm
        self._stuck_after_s = stuck_after_s
        # The job the worker thread is in, and since when: written by that thread, read by health()/restart().
        self._current_job: _Job | None = None
        self._job_started_at: float | None = None
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._library: _Library | None = None

    def voices(self) -> Sequence[str]:
        return tuple(self._voices)

    def model_identity(self, voice: str) -> str:
        # the bundled library and data come with the wheel: its version names them
        return f"espeak:{_loader_version()}:{self._voices.get(voice, voice)}:{self._rate_wpm}wpm"

    @property
    def default_voice(self) -> str:
        return self._default_voice

    def health(self) -> EngineHealth:
        thread = self._thread
        if thread is None:
            return EngineHealth("down", reason="not started")
        if not thread.is_alive():
            return EngineHealth("down", reason="speech thread died")
        started = self._job_started_at
        if started is not None and time.monotonic() - started > self._stuck_after_s:
            return EngineHealth("down", reason=f"speech thread stuck in one job for over {self._stuck_after_s:g} s")
        return EngineHealth("ready", queue_depth=self._jobs.qsize())

    async def restart(self) -> None:
        """A hung thread cannot be stopped from Python: abandon it (its jobs fail) and start a new one."""
        old, stopping, jobs, current = self._thread, self._stopping, self._jobs, self._current_job
        self._thread = None
        stopping.set()
        jobs.put(None)
        self._current_job, self._job_started_at = None, None
        if current is not None:  # the job the thread died in, or hangs in: its call ends now
            current.channel.fail(SynthesisFailed("espeak engine restarted"))
        if old is not None and old.is_alive():
            await asyncio.to_thread(old.join, 1.0)
        while not jobs.empty():
            if (job := jobs.get()) is not None:
                job.channel.fail(SynthesisFailed("espeak engine restarted"))
        await self.start()

    async def start(self) -> None:
        """Load the library and check every configured voice on the worker thread."""
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._stopping = threading.Event()  # a fresh start after close()
        self._jobs = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, args=(ready,), name="espeak-synth", daemon=True)
        self._thread.start()
        try:
            await asyncio.wrap_future(ready)
        except BaseException:
            await asyncio.to_thread(self._thread.join)
            self._thread = None
            raise
        log.info("engine_started", engine=self.name, voices=self._voices,
                 native_rate=self._library.native_rate if self._library else None)

    async def close(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._jobs.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        self.validate(request)
        if self._thread is None or self._stopping.is_set():
            raise RuntimeError("espeak engine is not running; call start() first")
        if request.segments:
            return speak_segments(self, request)
        channel = ChunkChannel()
        self.streams_opened += 1
        rate_wpm = round(self._rate_wpm * float(request.options.get("rate", 1.0)))
        self._jobs.put(_Job(request.text, self._voices[request.voice], channel, request.call_id, rate_wpm))
        return channel

    # -- the worker thread ------------------------------------------------------------------------
    def _work(self, ready: concurrent.futures.Future[None]) -> None:
        jobs, stopping = self._jobs, self._stopping  # this thread's own, even after a restart replaces them
        try:
            self._library = _Library.get()
            for name, voice in self._voices.items():
                if not self._library.has_voice(voice):
                    raise EngineSettingsError(f"engine.espeak.voices.{name}", voice,
                                              "is not a voice of the espeak-ng data installed")
        except BaseException as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        turns: deque[_Job] = deque()  # jobs with pieces left, spoken a piece each in turn
        while True:
            try:  # wait only when there is nothing to speak; newcomers join the end of the turn
                while True:
                    job = jobs.get(block=not turns)
                    if job is None:
                        break
                    turns.append(job)
            except queue.Empty:
                job = turns[0]
            if job is None:
                break
            job = turns.popleft()
            if stopping.is_set():
                job.channel.fail(SynthesisFailed("espeak engine closed"))
                continue
            self._current_job, self._job_started_at = job, time.monotonic()
            more = False
            try:
                more = self._speak(job, stopping)
            except Exception as exc:  # one request's failure ends its stream, never the thread
                log.exception("espeak_job_failed", call_id=job.call_id)
                job.channel.fail(SynthesisFailed(f"espeak: {exc!r}"))
            # Not in a `finally`: if the thread dies, the job stays recorded so restart() can fail its stream.
            if self._jobs is jobs:  # an abandoned (restarted-away) thread must not clear its successor's
                self._current_job, self._job_started_at = None, None
            if more:
                turns.append(job)
        # Streams in turn or queued behind the stop marker are failed rather than left hanging.
        for job in turns:
            job.channel.fail(SynthesisFailed("espeak engine closed"))
        while not jobs.empty():
            if (job := jobs.get()) is not None:
                job.channel.fail(SynthesisFailed("espeak engine closed"))

    def _speak(self, job: _Job, stopping: threading.Event) -> bool:
        """Speak the job's next piece; True when pieces are left for a later turn."""
        library = self._library
        assert library is not None
        if job.synthesis is None:
            job.synthesis = _Synthesis(job.channel, library.native_rate, stopping)
        synthesis = job.synthesis
        if job.channel.cancelled or not job.pieces:
            return False
        text = job.pieces.popleft().encode("utf-8") + b"\0"
        with library.lock:
            library.on_audio = synthesis
            try:
                status = library.lib.espeak_SetVoiceByName(job.espeak_voice.encode())
                if status == _EE_OK:
                    library.lib.espeak_SetParameter(_RATE, job.rate_wpm, 0)
                    status = library.lib.espeak_Synth(text, len(text), 0, _POS_CHARACTER, 0, _CHARS_UTF8,
                                                      None, None)
            finally:
                library.on_audio = None
        if synthesis.error is not None:
            job.channel.fail(SynthesisFailed(f"espeak: {synthesis.error!r}"))
        elif stopping.is_set():
            job.channel.fail(SynthesisFailed("espeak engine closed"))
        elif job.channel.cancelled:
            return False
        elif status != _EE_OK:
            job.channel.fail(SynthesisFailed(f"espeak: synthesis failed with status {status}"))
        elif job.pieces:
            return True
        else:
            synthesis.flush()
            job.channel.finish()
        return False
