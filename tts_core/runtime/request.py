"""SynthesisJob: one request's state while the scheduler serves it (nano-vllm's `Sequence` role).

A job speaks its text segments in order within one audio stream: each segment is one LM
generation (its own prefill in the job's KV slot, its own token history) and one flow/vocoder
stream (`chunk_render.PooledChunkStream`), as the official loop over normalised segments does. The job owns its random
generators (seeded), its chunk planner and its timings; the scheduler owns everything shared.

After `submit` two scheduler threads share a job, each owning its half (see
tts_core.runtime.scheduler):
- the decode thread: `segment`, `slot`, `tokens`, `kv_len`, `lm_finished`, `lm_s`
  (it appends tokens and sets `lm_finished` under the scheduler's lock, so that the render thread
  reads both as one snapshot);
- the render thread: `planner`, `pending_chunk`, `token2wav`, `audio_s`, `tokens_rendered`, chunk timings, and the
  hand-over flags `segment_rendered` and `wake_render_at` (set under the lock).
A segment changes hands twice: `start_segment` (decode, under the lock) gives it to the render
thread, which gives it back by setting `segment_rendered` once its last chunk went out; the decode
thread never starts a segment the render thread may still be rendering. The consumer's thread only
sets `sink.cancelled`.
"""

from __future__ import annotations

import secrets
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask
from tts_core.voices import Voice

if TYPE_CHECKING:
    from tts_core.runtime.chunk_render import PooledChunkStream


class AudioSink(Protocol):
    """Where a job's audio goes (engines.channel.ChunkChannel satisfies it). Calls never block."""

    @property
    def cancelled(self) -> bool: ...

    def put(self, chunk: np.ndarray) -> None: ...

    def finish(self) -> None: ...

    def fail(self, error: BaseException) -> None: ...


class SynthesisError(RuntimeError):
    """A job broke while being served; given to its sink's `fail`, never to other jobs."""


class NothingToSpeak(ValueError):
    """The text normalises to nothing speakable (only punctuation, or empty): refused at submit."""


@dataclass(frozen=True)
class JobOptions:
    # None: a fresh random seed per job. It seeds the flow and vocoder noise; token draws are
    # batched on the device and come from the decoder's generator.
    seed: int | None = None
    min_tokens: int | None = None  # per segment; None: the model's text-length bound
    max_tokens: int | None = None  # per segment; min_tokens == max_tokens forces the count (benchmarks)
    schedule: ChunkSchedule | None = None  # None: the scheduler's
    # CosyVoice3 instruct (`inference_instruct2`): these text tokens (an instruct ending in
    # <|endofprompt|>) replace the voice's prompt text and the LM gets no prompt speech; the flow keeps
    # the voice. Conditions the speech, never spoken (it is not part of the segments' text).
    instruct_tokens: tuple[int, ...] | None = None
    # False: the audio is collected whole before anyone hears it (a file to download, a cache prerender),
    # not played as it comes. Its chunks are then never deferred on slack (nobody's playout paces them):
    # each is rendered once its tokens are there, ranked after every live stream (`SynthesisJob.deadline`).
    paced: bool = True


@dataclass(frozen=True)
class ChunkTiming:
    segment: int
    index: int
    tokens: int  # tokens rendered by this chunk (its hop, or the rest when final)
    lm_s: float  # decode/sampling wall time of this job's steps since its previous chunk (both taken at render start)
    flow_s: float
    hift_s: float
    handoff_s: float
    audio_s: float
    at_s: float  # when it was handed to the sink, seconds since submit
    flow_gpu_s: tuple[float, float] | None = None  # the flow call's (encoder, solve) stream time, if timed
    hift_gpu_s: tuple[float, float] | None = None  # the vocoder call's (host launch, stream time), if timed


@dataclass
class JobTimings:
    submitted: float = field(default_factory=time.perf_counter)
    queued: float | None = None  # in the scheduler's waiting list (its lock taken)
    admitted: float | None = None
    frontend_s: float = 0.0  # text normalisation and tokenisation (on the submitting thread)
    prefill_done: float | None = None
    first_token: float | None = None
    first_chunk_due: float | None = None  # its first chunk's tokens were all drawn (or the LM ended)
    first_render_started: float | None = None  # the render call of its first chunk began
    first_chunk: float | None = None
    finished: float | None = None
    prefill_s: float = 0.0
    chunks: list[ChunkTiming] = field(default_factory=list)

    def since_submit(self, at: float | None) -> float | None:
        return None if at is None else at - self.submitted

    def first_chunk_stages(self) -> dict[str, float] | None:
        """Seconds in each stage from submit to the first chunk's hand-off (FIRST_CHUNK_STAGES), or None
        before the first chunk."""
        marks = [getattr(self, mark) for _, mark in FIRST_CHUNK_STAGES] + [self.first_chunk]
        if None in marks:
            return None
        return {name: b - a for (name, _), a, b in zip(FIRST_CHUNK_STAGES, marks, marks[1:])}


# (stage, the JobTimings mark it starts at); each ends where the next starts, the last at `first_chunk`.
# "submit": the text frontend and the job's way into the waiting list (the scheduler's lock, the GIL);
# "queue": until the decode thread admits it (its iteration in progress); "decode": the first chunk's tokens;
# "render_wait": for a render lane.
FIRST_CHUNK_STAGES = (("submit", "submitted"), ("queue", "queued"), ("prefill", "admitted"),
                      ("decode", "prefill_done"), ("render_wait", "first_chunk_due"),
                      ("render", "first_render_started"))


class SynthesisJob:
    def __init__(self, text: str, segments: list[list[int]], voice: Voice, sink: AudioSink,
                 options: JobOptions = JobOptions(), call_id: str = "") -> None:
        """`segments`: the text's tokens per segment, from the text frontend on the caller's thread."""
        if not segments:
            raise NothingToSpeak(f"nothing to speak in {text!r}")
        self.text = text
        self.segments = segments
        self.voice = voice
        self.sink = sink
        self.options = options
        self.call_id = call_id
        # secrets, not torch.seed(): that would reseed the process-wide generator.
        seed = options.seed if options.seed is not None else secrets.randbits(62)
        self.seed = seed
        self.timings = JobTimings()
        # Filled by the scheduler's decode thread:
        self.segment = -1  # index of the segment being spoken
        self.slot: int | None = None
        self.tokens: list[int] = []  # speech tokens of the current segment (a new list per segment)
        # What the flow renders: `tokens` itself, or (CosyVoice3) those its silent-run filter keeps.
        self.flow_tokens: list[int] = self.tokens
        self._token_filter = None  # llm.silence_filter.SilentRunFilter of the segment, or None
        self.kv_len = 0  # cache positions written in this job's slot (host copy, for the decode bound)
        self.min_len = 0
        self.max_len = 0
        self.lm_finished = False
        self.lm_s = 0.0  # decode/sampling wall time of this job's steps so far
        # Filled by the scheduler's render thread:
        self.planner: ChunkPlanner | None = None  # None: the segment's rendering is not set up yet
        self.pending_chunk: ChunkTask | None = None  # issued by the planner, deferred (slack or batch size)
        self.token2wav: PooledChunkStream | None = None  # the segment's flow slot + vocoder
        self.render_lane: object | None = None  # the RenderLoop that has claimed the job's next chunk
        self.segment_rendered = False  # the segment's last chunk went out: the decode thread may go on
        self.wake_render_at = 0  # token count at which the decode thread wakes the render thread
        self.lm_s_charged = 0.0  # the part of lm_s already attributed to chunks
        self.tokens_rendered = 0  # of the current segment's tokens, those whose audio went out
        self.audio_s = 0.0
        self.done = False

    # ---- state the scheduler asks about ----------------------------------------------------------
    @property
    def cancelled(self) -> bool:
        return self.sink.cancelled

    @property
    def generating(self) -> bool:
        return self.slot is not None and not self.lm_finished and bool(self.tokens)

    def held_for_first_chunk(self, now: float, hold_s: float) -> float:
        """Seconds this job's hold lasts (0: not held; the scheduler pauses decoding only while
        every generating job is held). Held while its first chunk's tokens are all drawn and that
        chunk is not handed off yet, for at most `hold_s`: the next tokens are not needed until that
        chunk has played for a while, and decode steps drawn for them would share the GPU with the
        chunk's render, which a caller is waiting on. An unpaced job is never held: nobody waits on
        its first chunk, and the file needs its next tokens at once."""
        due = self.timings.first_chunk_due
        if not self.options.paced or due is None or self.timings.first_chunk is not None:
            return 0.0
        return max(0.0, due + hold_s - now)

    def next_chunk(self) -> ChunkTask | None:
        """The chunk to render now (a deferred one first); the caller renders it or defers it again."""
        if self.pending_chunk is not None:
            task, self.pending_chunk = self.pending_chunk, None
            return task
        if self.planner is None:
            return None
        return self.planner.next_chunk(len(self.flow_tokens), self.lm_finished)

    def deadline(self) -> tuple[int, float]:
        """Sort key for rendering: jobs without audio first (oldest first), then the job whose emitted
        audio runs out soonest (playout assumed to start at its first chunk); unpaced jobs (collected
        whole, `JobOptions.paced`) after all of them, oldest first: a live call never waits for a file."""
        t = self.timings
        if not self.options.paced:
            return (2, t.submitted)
        if t.first_chunk is None:
            return (0, t.submitted)
        return (1, t.first_chunk + self.audio_s)

    def slack(self, now: float) -> float:
        """Seconds of emitted audio not yet played at `now` (playout from the first chunk); 0 before it."""
        if self.timings.first_chunk is None:
            return 0.0
        return self.timings.first_chunk + self.audio_s - now

    def lead_s(self, now: float, token_s: float) -> float:
        """Seconds of speech ahead of the listener at `now`: audio handed out and not yet played
        (`slack`), plus the current segment's decoded tokens not yet rendered (`token_s` each)."""
        return self.slack(now) + (len(self.flow_tokens) - self.tokens_rendered) * token_s

    def figures(self) -> dict:
        """What the job's last log line says: its audio, and where its first chunk's time went (ms per stage)."""
        t = self.timings
        stages = t.first_chunk_stages() or {}
        # Where the first chunk's render stage went: its batched flow call and its vocoder call (the rest is the
        # render thread's own work and waits); and its hand-off to the sink, which follows the stage.
        render = {f"first_render_{name}_ms": round(getattr(t.chunks[0], f"{name}_s") * 1e3, 1)
                  for name in ("flow", "hift", "handoff")} if t.chunks else {}
        if t.chunks and (flow_gpu := t.chunks[0].flow_gpu_s) is not None:  # stream time, where timed (CUDA)
            render.update(first_render_flow_encoder_gpu_ms=round(flow_gpu[0] * 1e3, 1),
                          first_render_flow_solve_gpu_ms=round(flow_gpu[1] * 1e3, 1))
        if t.chunks and (hift_gpu := t.chunks[0].hift_gpu_s) is not None:
            render["first_render_hift_gpu_ms"] = round(hift_gpu[1] * 1e3, 1)
        # Whether the second chunk came before the first one's audio ran out (its margin: what was left of that
        # audio when it was handed over; below 0 the listener ran dry, the gateway's own buffer aside), and where
        # its time went: the decode steps it waited for and its render call.
        second = {}
        if len(t.chunks) > 1 and t.chunks[1].segment == t.chunks[0].segment:
            first, then = t.chunks[0], t.chunks[1]
            after = then.at_s - first.at_s
            second = {"second_chunk_after_ms": round(after * 1e3, 1),
                      "second_chunk_margin_ms": round((first.audio_s - after) * 1e3, 1),
                      "second_chunk_decode_ms": round(then.lm_s * 1e3, 1),
                      "second_chunk_render_ms": round((then.flow_s + then.hift_s) * 1e3, 1)}
        return {"call_id": self.call_id, "audio_s": round(self.audio_s, 3), "chunks": len(t.chunks),
                "first_chunk_s": t.since_submit(t.first_chunk), "frontend_ms": round(t.frontend_s * 1e3, 1),
                **{f"first_chunk_{name}_ms": round(seconds * 1e3, 1) for name, seconds in stages.items()}, **render,
                **second}

    def lm_prompt(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(prompt text tokens, LM prompt speech tokens) of the prefill: the voice's, or an instruct's."""
        if self.options.instruct_tokens is not None:
            return self.options.instruct_tokens, ()
        return self.voice.prompt_text, self.voice.llm_prompt_speech_token

    # ---- transitions ---------------------------------------------------------------------------
    def start_segment(self, min_len: int, max_len: int, token_filter=None) -> None:
        """Decode thread, under the scheduler's lock: the next segment's LM side; its rendering is
        set up by the render thread (`start_rendering`), whose device stream its tensors live on.
        `token_filter` (CosyVoice3's silent-run cap) decides which tokens the flow gets."""
        self.segment += 1
        self.tokens = []
        self.flow_tokens = self.tokens if token_filter is None else []
        self._token_filter = token_filter
        self.lm_finished = False
        self.min_len, self.max_len = min_len, max_len
        self.planner = None
        self.pending_chunk = None
        self.token2wav = None
        self.segment_rendered = False
        self.wake_render_at = 0
        self.tokens_rendered = 0

    def start_rendering(self, planner: ChunkPlanner, token2wav: PooledChunkStream) -> None:
        """Render thread: the current segment's chunk planner and token -> waveform stream."""
        self.planner = planner
        self.token2wav = token2wav

    @property
    def has_next_segment(self) -> bool:
        return self.segment + 1 < len(self.segments)

    def plan_wake(self) -> None:
        """Render thread, under the lock: the token count at which new tokens make a chunk plannable
        (never, while a chunk waits on slack: the render thread wakes on its own clock for it)."""
        if self.planner is None:
            self.wake_render_at = 0
        elif self.planner.done or self.pending_chunk is not None:
            self.wake_render_at = sys.maxsize
        else:
            self.wake_render_at = self.planner.tokens_needed()

    def take_lm_s(self) -> float:
        """Render thread: decode time since the previous chunk's tokens were taken for rendering."""
        total = self.lm_s
        taken, self.lm_s_charged = total - self.lm_s_charged, total
        return taken

    def accept_token(self, token: int, speech_token_size: int) -> None:
        """Take one sampled token; a stop token, or reaching max_len, ends the segment's LM."""
        now = time.perf_counter()
        if self.timings.first_token is None:
            self.timings.first_token = now
        if token >= speech_token_size:
            self.lm_finished = True
        else:
            self.tokens.append(token)
            if self._token_filter is not None and self._token_filter.keep(token):
                self.flow_tokens.append(token)
            if len(self.tokens) >= self.max_len:
                self.lm_finished = True
        timings = self.timings
        if timings.first_chunk_due is None and self.planner is not None and (
                self.lm_finished or len(self.flow_tokens) >= self.wake_render_at):
            timings.first_chunk_due = now

    def record_chunk(self, timing: ChunkTiming, handed_at: float) -> None:
        if self.timings.first_chunk is None:
            self.timings.first_chunk = handed_at
        self.audio_s += timing.audio_s
        self.tokens_rendered += timing.tokens
        self.timings.chunks.append(timing)
