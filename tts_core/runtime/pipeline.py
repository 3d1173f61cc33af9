"""CosyVoice2Pipeline: a loaded model directory, ready to stream (the `LLMEngine` role of nano-vllm).

`load` builds every part from the model directory (text frontend, speech LM, flow, HiFT with
weight norm folded, voices) on one device and starts the scheduler's threads that own them. The
directory may hold CosyVoice2 or CosyVoice3: the family is read from it, and `runtime/family.py`
supplies what differs (parts, chunk renderer, token filter); everything else is shared.
`synthesize` is the thread-safe entry point: it wraps a text, a voice name and a sink in a
`SynthesisJob` and submits it. Nothing here runs model code on the caller's thread except
`warmup`, which waits for one short job to stream end to end.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import structlog
import torch

from tts_core.accel.fp8_linear import use_fp8_projections
from tts_core.llm.sampling import RasSampler
from tts_core.model_dir import ModelDir
from tts_core.runtime.collecting_sink import CollectingSink
from tts_core.runtime.family import RuntimeFamily, runtime_family
from tts_core.runtime.request import JobOptions, SynthesisError, SynthesisJob
from tts_core.runtime.scheduler import SynthesisScheduler
from tts_core.runtime.settings import SchedulerSettings
from tts_core.streaming.chunk_schedule import ChunkSchedule
from tts_core.text.frontend import TextFrontend
from tts_core.text.normalize import TextNormalizer
from tts_core.voices import Voice, VoiceBank

log = structlog.get_logger(__name__)

WARMUP_TEXT = "Hello, this is a warm up."
WARMUP_TOKENS = 60  # a first chunk and a final one: every kernel of the chunk path runs once


def startup_stages(startup: dict, warmup_s: float | None) -> dict:
    """`CosyVoice2Pipeline.startup` and the warm-up's seconds as the operator reads them: weights,
    voices, per captured part its seconds with the compile / warm-up runs / recording split and
    graph count, the warm-up synthesis, and whether the compiler cache was warm (no inductor cache
    misses: "warm"; only misses: "cold"; both: "partial"; nothing compiled: "unused")."""
    parts = {}
    hits = misses = 0
    for part in ("flow", "hift", "decode", "prefill"):
        stages = startup.get(f"{part}_stages")
        if stages is None:
            continue
        hits += stages["cache_hits"]
        misses += stages["cache_misses"]
        parts[part] = {"s": round(startup[f"{part}_capture_s"], 2), "compile_s": stages["compile_s"],
                       "warmup_runs_s": round(stages["warmup_s"] - stages["compile_s"], 2),
                       "record_s": stages["record_s"], "graphs": stages["graphs"], "compiles": stages["compiles"]}
        if stages.get("deferred"):
            parts[part]["deferred_buckets"] = stages["deferred"]  # captured after ready: compiled_graphs_complete
    cache = "unused" if not hits + misses else "warm" if not misses else "cold" if not hits else "partial"
    out = {"weights_s": round(startup.get("weights_s", 0.0), 2),
           "weights": {k: round(v, 2) for k, v in startup.get("weights_split", {}).items()},
           "voices_s": round(startup.get("flow_voices_s", 0.0), 2),
           "capture_s": round(startup.get("capture_s", 0.0), 2), "capture": parts,
           "warmup_s": None if warmup_s is None else round(warmup_s, 3),
           "compiler_cache": cache, "cache_hits": hits, "cache_misses": misses}
    if "flow_later_s" in startup:
        out["flow_lanes_s"] = {"later": round(startup["flow_later_s"], 2), "first": round(startup["flow_first_s"], 2)}
    return out


class CosyVoice2Pipeline:
    def __init__(self, model_dir: ModelDir, frontend: TextFrontend, voices: VoiceBank,
                 scheduler: SynthesisScheduler, device: torch.device, dtype: torch.dtype) -> None:
        self.model_dir = model_dir
        self.frontend = frontend
        self.voices = voices
        self.scheduler = scheduler
        self.device = device
        self.dtype = dtype
        # Start-up stages (`load`): weights_s (model parts and voices onto the device), the
        # scheduler's capture report (per part: seconds, compile/warm-up/record split) and total_s.
        self.startup: dict = {}

    @classmethod
    def load(cls, model_dir: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
             voices_dir: str | Path | None = None, max_batch: int = 8, max_len: int = 2048,
             schedule: ChunkSchedule = ChunkSchedule(), fast: SchedulerSettings | None = None,
             normalize: bool = True, llm_fp8: bool = False) -> CosyVoice2Pipeline:
        """`fast`: scheduler settings whose fast-path fields (flow window, graphs, buckets, deferral
        slack) are used; max_batch/max_len/schedule come from the arguments. `llm_fp8`: the LM's
        decoder-layer projections in FP8 (tts_core/accel/fp8_linear.py; ValueError with the reason
        where the device has no FP8 matmuls). With graphs, every
        graph is captured here, before the first request (the time is logged and kept in
        `scheduler.capture_report`)."""
        started = time.perf_counter()
        split: dict[str, float] = {}
        md = ModelDir.open(model_dir)
        family = runtime_family(md)
        device = torch.device(device)
        # The modules are made on the device, so their random initialisation (overwritten by the
        # checkpoint at once) runs there and not on the host's cores; the checkpoints are read
        # memory-mapped (tts_core.checkpoint) and copied straight to the device.
        with torch.device(device):
            parts = family.load(md, device, dtype)
        tokenizer, lm, flow, hift = parts.tokenizer, parts.lm, parts.flow, parts.hift
        split["parts_s"] = time.perf_counter() - started
        frontend = TextFrontend(tokenizer, TextNormalizer(tokenizer) if normalize else None)
        if llm_fp8:
            fp8 = use_fp8_projections(lm)
            log.info("tts_llm_fp8_weights", projections=fp8.projections, dense_mb=round(fp8.dense_bytes / 2**20),
                     fp8_mb=round(fp8.fp8_bytes / 2**20))
        voices = VoiceBank.load(md.root, voices_dir)
        for name in voices.names():  # CosyVoice3: a prompt text without <|endofprompt|> would speak garbage
            try:
                lm.check_request((), voices.get(name).prompt_text)
            except ValueError as exc:
                raise ValueError(f"voice {name!r} of {md.root}: {exc}") from None
        split["voices_s"] = time.perf_counter() - started - sum(split.values())
        weights_s = time.perf_counter() - started
        # The flow pool holds every voice of the bank, plus room for two registered later.
        settings = replace(fast or SchedulerSettings(), max_batch=max_batch, max_len=max_len, schedule=schedule,
                           flow_voice_slots=len(voices.names()) + 2)
        if settings.graphs and device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        scheduler = SynthesisScheduler(lm, RasSampler(md.sampling, lm.speech_token_size), flow, hift, settings, family)
        scheduler.capture([voices.get(name) for name in voices.names()])
        scheduler.start()
        total_s = time.perf_counter() - started
        log.info("tts_pipeline_loaded", model_dir=str(md.root), family=family.version, device=str(device), dtype=str(dtype), llm_fp8=llm_fp8,
                 voices=len(voices), max_batch=max_batch, max_len=max_len, seconds=round(total_s, 3))
        pipeline = cls(md, frontend, voices, scheduler, device, dtype)
        pipeline.startup = {"weights_s": weights_s, "weights_split": split, **scheduler.capture_report,
                            "total_s": total_s}
        return pipeline

    @property
    def family(self) -> RuntimeFamily:
        return self.scheduler.family

    def instruct_tokens(self, instruct: str | None, dialect: str | None) -> tuple[int, ...] | None:
        """The prompt tokens of a CosyVoice3 instruct or dialect by name (None: neither, the voice's
        own prompt). ValueError names the field: an unknown name, both given, or a CosyVoice2 model."""
        if instruct is None and dialect is None:
            return None
        if not self.family.instructs:
            field = "instruct" if instruct is not None else "dialect"
            raise ValueError(f"{field}: CosyVoice{self.family.version} models take no instruct or dialect "
                             "(CosyVoice3 does)")
        from tts_core.text.cosyvoice3 import instruct_text

        return tuple(self.frontend.tokenizer.encode(instruct_text(instruct, dialect)))

    def synthesize(self, text: str, voice: str, sink, options: JobOptions = JobOptions(),
                   call_id: str = "") -> SynthesisJob:
        """Queue `text` in `voice`; audio arrives on `sink` from the scheduler's render thread.
        Thread-safe. Raises NothingToSpeak, before anything is queued, for a text with nothing to say."""
        job = self.make_job(text, self.voices.get(voice), sink, options, call_id)
        self.scheduler.submit(job)
        return job

    def make_job(self, text: str, voice: Voice, sink, options: JobOptions = JobOptions(),
                 call_id: str = "") -> SynthesisJob:
        """A job for `text`, its text frontend (normalise, split, tokenise) run here, on the
        caller's thread, so the decode thread never does text work."""
        started = time.perf_counter()
        job = SynthesisJob(text, self.frontend(text), voice, sink, options, call_id)
        job.timings.submitted = started
        job.timings.frontend_s = time.perf_counter() - started
        return job

    def warmup(self, voice: str | None = None, text: str = WARMUP_TEXT) -> float:
        """Stream one short request end to end (first-call allocations, kernels); returns its seconds."""
        names = self.voices.names()
        if voice is None and not names:
            raise SynthesisError("warm-up needs a voice; the model directory has none")
        sink = CollectingSink()
        started = time.perf_counter()
        self.synthesize(text, voice or names[0], sink, JobOptions(seed=0, max_tokens=WARMUP_TOKENS),
                        call_id="warmup")
        sink.wait()
        seconds = time.perf_counter() - started
        log.info("tts_warmup_done", seconds=round(seconds, 3), audio_s=round(sink.samples() / 24_000, 3))
        return seconds

    def close(self) -> None:
        self.scheduler.stop()
