"""CosyVoice2Engine: adapts tts_core's CosyVoice2Pipeline to the gateway's SpeechEngine interface.

It serves CosyVoice2 and CosyVoice3 model directories alike (`engine.cosyvoice2.model_dir`): the family is
read from the directory. A directory that is not a usable model of either family is refused at start, in one
line naming the file or the disagreeing class (EngineSettingsError: exit 2 in a worker). A CosyVoice3 model
takes the request options `instruct` / `dialect` (names from the authors' fixed list, tts_core/text/cosyvoice3.py),
which condition the speech as its LM prompt and are never spoken; a CosyVoice2 model refuses them (400).

Loading (seconds to a minute) and warm-up run in a worker thread, never on the event loop; after
that, `open_stream` only queues a job: the scheduler's threads render it and hand chunks to the
stream's ChunkChannel. The text frontend (normalise, split, tokenise: ~10 ms for a 300-character text) runs
on a thread of its own unless the text was spoken recently: the stream is then admitted once its job is
queued, and a text with nothing to say is refused through the channel, still before any audio. A job that
breaks ends its own stream with SynthesisFailed; `close()` stops the scheduler and ends every open stream
the same way.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import structlog

from engines.base import (INSTRUCT_OPTIONS, EmptyText, EngineHealth, EngineSettingsError, EngineUnavailable,
                          SpeechEngine, SynthesisFailed, SynthesisRefused, SynthesisRequest, UnsupportedOption)
from engines.channel import ChunkChannel
from engines.cosyvoice2.settings import CosyVoice2Settings
from engines.segmented import speak_segments
from speech_audio.model_identity import files_identity

log = structlog.get_logger(__name__)

REQUEST_OPTIONS = ("seed", "min_tokens", "max_tokens", *INSTRUCT_OPTIONS)  # per-request knobs a caller may set
SEGMENT_ROOM = 256  # KV positions a text segment and its first speech need beyond the prompt
LATE_REASON = "behind real time"  # health's reason while `shed_late_s` sheds


class _ChannelSink:
    """Hands a job's audio to its channel; turns runtime errors into the interface's SynthesisFailed."""

    def __init__(self, channel: ChunkChannel) -> None:
        self._channel = channel

    @property
    def cancelled(self) -> bool:
        return self._channel.cancelled

    def put(self, chunk: np.ndarray) -> None:
        self._channel.put(chunk)

    def finish(self) -> None:
        self._channel.finish()

    def fail(self, error: BaseException) -> None:
        self._channel.fail(error if isinstance(error, SynthesisFailed) else SynthesisFailed(str(error)))


class CosyVoice2Engine(SpeechEngine):
    name = "cosyvoice2"

    def __init__(self, **settings: Any) -> None:
        self.settings = CosyVoice2Settings.from_config(settings)
        self.pipeline = None  # tts_core.runtime.CosyVoice2Pipeline once started
        self.warmup_s: float | None = None
        self._frontend_thread: ThreadPoolExecutor | None = None
        self._identity: str | None = None

    def model_identity(self, voice: str) -> str:
        # checkpoints and every voice's prompt data, by name, size and mtime (speech_audio/model_identity.py)
        if self._identity is None:
            self._identity = files_identity("cosyvoice2", self.settings.model_dir, self.settings.voices_dir)
        return self._identity

    async def start(self) -> None:
        if self.pipeline is None:
            self.pipeline = await asyncio.to_thread(self._load)
            # One thread: the FST normaliser takes a lock anyway, and jobs are queued in the order opened.
            self._frontend_thread = ThreadPoolExecutor(1, thread_name_prefix="cosyvoice2-frontend")

    def _load(self):
        from tts_core.runtime import CosyVoice2Pipeline, SchedulerSettings
        from tts_core.runtime.pipeline import startup_stages
        from tts_core.streaming.chunk_schedule import ChunkSchedule

        from tts_core.accel.device_memory import DeviceMemoryShort
        from tts_core.model_dir import ModelDir

        s = self.settings
        try:  # the family and every file, before any weight is read: one line naming what is wrong
            family = ModelDir.open(s.model_dir).family.version
        except ValueError as exc:  # ModelDirError, ModelFamilyError
            raise EngineSettingsError("engine.cosyvoice2.model_dir", str(s.model_dir), f"is not usable: {exc}") from None
        if family == 3 and s.flow_context_int8:  # its DiT pool keeps keys and values, in the model's dtype
            raise EngineSettingsError("engine.cosyvoice2.flow_context_int8", True,
                                      "applies to CosyVoice2 models only; this is a CosyVoice3 model directory")
        device, dtype = s.resolve()
        graphs, encoder_tokens = s.fast_path(device)
        started = time.perf_counter()
        try:
            pipeline = CosyVoice2Pipeline.load(
                s.model_dir, device=device, dtype=dtype, voices_dir=s.voices_dir, max_batch=s.max_batch, max_len=s.max_len,
                schedule=ChunkSchedule(hop_tokens=s.hop_tokens, max_hop_tokens=s.max_hop_for(family),
                                       first_hop_tokens=s.first_hop_tokens),
                fast=SchedulerSettings(graphs=graphs, flow_encoder_tokens=encoder_tokens,
                                       flow_context_frames=s.flow_context_frames,
                                       flow_context_int8=s.flow_context_int8, compile_flow=s.compile_flow,
                                       compile_hift=s.compile_hift, slot_attention=s.slot_attention,
                                       first_chunk_lanes=s.first_chunk_lanes),
                llm_fp8=s.llm_fp8)
        except DeviceMemoryShort as exc:  # refused before the pool's allocation: one line naming the keys, exit 2
            raise EngineSettingsError("engine.cosyvoice2.max_batch", s.max_batch,
                                      f"with flow_context_s {s.flow_context_s}: {exc}; lower max_batch or "
                                      "flow_context_s, or set flow_context_int8 (half the pool)") from None
        try:
            if not pipeline.voices.names():
                raise ValueError(f"engine.cosyvoice2: no voices in {s.model_dir} (add one with `voice add`)")
            if s.default_voice is not None and s.default_voice not in pipeline.voices:
                raise EngineSettingsError("engine.cosyvoice2.default_voice", s.default_voice,
                                          f"is not a voice of {s.model_dir} ({', '.join(pipeline.voices.names())})")
            load_s = time.perf_counter() - started
            if s.warmup:
                self.warmup_s = pipeline.warmup(s.default_voice)
        except BaseException:
            pipeline.close()
            raise
        stages = startup_stages(pipeline.startup, self.warmup_s)
        stages["total_s"] = round(time.perf_counter() - started, 2)  # load + warm-up
        stages["process_s"] = _process_age_s()  # since the process began: imports and CUDA set-up too
        log.info("cosyvoice2_engine_started", family=pipeline.family.version, stages=stages, device=device, dtype=str(dtype), llm_fp8=s.llm_fp8, graphs=graphs,
                 compile_flow=graphs and s.compile_flow, compile_hift=graphs and s.compile_hift,
                 slot_attention=graphs and s.slot_attention,
                 first_chunk_lanes=s.first_chunk_lanes,
                 # Ready on graphs of the eager modules; the compiled ones follow while serving
                 # (compiled_graphs_complete): until then first chunks are slower.
                 eager_graphs_until_compiled=graphs,
                 flow_encoder_tokens=encoder_tokens,
                 flow_context_s=s.flow_context_s, flow_context_int8=s.flow_context_int8, load_s=round(load_s, 3),
                 warmup_s=self.warmup_s and round(self.warmup_s, 3), voices=len(pipeline.voices))
        return pipeline

    async def prepare(self, texts: Sequence[str]) -> None:
        """The texts' frontend results, remembered before any call (the frontend keeps the last 256 texts)."""
        if self.pipeline is None or self._frontend_thread is None or not texts:
            return
        started = time.perf_counter()
        failed = await asyncio.get_running_loop().run_in_executor(self._frontend_thread, _run_frontend,
                                                                  self.pipeline, texts)
        log.info("cosyvoice2_prompts_prepared", texts=len(texts), failed=failed,
                 seconds=round(time.perf_counter() - started, 3))

    async def close(self) -> None:
        pipeline, self.pipeline = self.pipeline, None
        frontend, self._frontend_thread = self._frontend_thread, None
        if pipeline is not None:
            await asyncio.to_thread(pipeline.close)
        if frontend is not None:  # after the scheduler stopped, so texts still queued there are refused
            await asyncio.to_thread(frontend.shutdown)

    def _running(self):
        if self.pipeline is None:
            raise RuntimeError("cosyvoice2 engine is not running; call start() first")
        return self.pipeline

    def health(self) -> EngineHealth:
        """Ready once started; `graphs` says whether the compiled graphs are in yet (the tts-compile thread's
        progress, a plain attribute of the scheduler): until then first chunks are slower. With `shed_late_s`, no
        free slot while a live stream is that late (the worker then refuses opens, an in-process gateway calls)."""
        pipeline = self.pipeline
        graphs = pipeline.scheduler.graphs_state if pipeline is not None else "compiled"
        late_s = self.settings.shed_late_s
        if pipeline is not None and late_s is not None and (late := pipeline.scheduler.late_streams(late_s)):
            return EngineHealth("ready", slots_free=0, reason=f"{LATE_REASON}: {late} live stream(s) over {late_s:g} s "
                                                             "behind their listeners", graphs=graphs)
        return EngineHealth("ready", graphs=graphs)

    def voices(self) -> Sequence[str]:
        return self._running().voices.names()

    @property
    def takes_instructs(self) -> bool:  # type: ignore[override]
        return self.pipeline is not None and self.pipeline.family.instructs

    @property
    def default_voice(self) -> str:
        return self.settings.default_voice or self.voices()[0]

    def validate(self, request: SynthesisRequest) -> None:
        super().validate(request)
        unknown = sorted(set(request.options) - set(REQUEST_OPTIONS))
        if unknown:
            raise SynthesisRefused(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(REQUEST_OPTIONS)}")
        # The model's own limit: each text segment is spoken after the voice prompt in one KV-cache
        # row, so the prompt must leave room for a segment and its speech.
        self._instruct_tokens(request)
        voice = self._running().voices.get(request.voice)
        prompt = 2 + len(voice.prompt_text) + len(voice.llm_prompt_speech_token)
        if prompt + SEGMENT_ROOM > self.settings.max_len:
            raise SynthesisRefused(f"voice {request.voice!r} has a {prompt}-position prompt; with max_len "
                                   f"{self.settings.max_len} no room is left to speak")

    def open_stream(self, request: SynthesisRequest) -> ChunkChannel:
        from tts_core.runtime import JobOptions

        self.validate(request)
        if request.segments:  # each speech segment is one job, pauses are silence between them
            return speak_segments(self, request)
        pipeline = self._running()
        options = JobOptions(seed=_int_option(request.options, "seed", self.settings.seed),
                             min_tokens=_int_option(request.options, "min_tokens"),
                             max_tokens=_int_option(request.options, "max_tokens"),
                             instruct_tokens=self._instruct_tokens(request), paced=request.paced)
        if pipeline.frontend.knows(request.text):  # a look-up: queue it here, admitted at once
            channel = ChunkChannel()
            _submit(pipeline, request, options, channel)
            return channel
        channel = ChunkChannel(admitted=False)
        assert self._frontend_thread is not None
        self._frontend_thread.submit(_submit_admitting, pipeline, request, options, channel)
        return channel


    def _instruct_tokens(self, request: SynthesisRequest) -> tuple[int, ...] | None:
        """The request's instruct / dialect as the model's prompt tokens; UnsupportedOption (400) names the field."""
        try:
            return self._running().instruct_tokens(request.options.get("instruct"), request.options.get("dialect"))
        except ValueError as exc:
            raise UnsupportedOption(str(exc)) from None


def _process_age_s() -> float | None:
    """Seconds since this process started (Linux /proc), None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return round(uptime - started_ticks / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def _run_frontend(pipeline, texts: Sequence[str]) -> int:
    """On the frontend thread: each text through the frontend, so it is remembered; how many failed (logged)."""
    failed = 0
    for text in texts:
        try:
            pipeline.frontend(text)
        except Exception:  # noqa: BLE001 - best effort: that prompt pays its frontend at its first call instead
            log.exception("cosyvoice2_prompt_prepare_failed", text=text[:80])
            failed += 1
    return failed


def _submit(pipeline, request: SynthesisRequest, options, channel: ChunkChannel) -> None:
    """Run the text frontend and queue the job; SynthesisRefused/SynthesisFailed name what went wrong."""
    from tts_core.runtime import NothingToSpeak

    try:
        pipeline.synthesize(request.text, request.voice, _ChannelSink(channel), options, request.call_id)
    except NothingToSpeak as exc:  # only punctuation once normalised: refused before the call is answered
        raise EmptyText(str(exc)) from exc
    except Exception as exc:  # the scheduler stopped between validate and submit
        raise SynthesisFailed(str(exc)) from exc


def _submit_admitting(pipeline, request: SynthesisRequest, options, channel: ChunkChannel) -> None:
    """On the frontend thread: queue the job, then settle the channel's admission either way."""
    if channel.cancelled:  # the caller left while the text waited here
        return
    try:
        _submit(pipeline, request, options, channel)
    except SynthesisRefused as exc:
        channel.refuse(exc)
    except SynthesisFailed as exc:
        channel.refuse(EngineUnavailable(str(exc)))
    except Exception as exc:  # noqa: BLE001 - a frontend bug refuses this stream, never hangs its caller
        log.exception("cosyvoice2_frontend_failed", call_id=request.call_id)
        channel.refuse(SynthesisRefused(f"text frontend failed: {exc!r}"))
    else:
        channel.admit()


def _int_option(options: Mapping[str, Any], key: str, default: int | None = None) -> int | None:
    value = options.get(key, default)
    return None if value is None else int(value)
