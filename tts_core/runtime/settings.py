"""SchedulerSettings: what the runtime trades, chosen once at start-up (engines/cosyvoice2 fills it
from the operator's config). Each setting says what it trades; the figures behind the defaults are
in docs/PERF_NOTES.md (H100 unless said otherwise)."""

from __future__ import annotations

from dataclasses import dataclass

from tts_core.accel.lm_graphs import HOST_BUFFERS
from tts_core.streaming.chunk_schedule import ChunkSchedule

# The most decode steps left unread: the graphed decoder rotates HOST_BUFFERS pinned buffers, and
# the step being launched needs one besides those of the unread steps.
MAX_STEPS_AHEAD = HOST_BUFFERS - 1


@dataclass(frozen=True)
class SchedulerSettings:
    max_batch: int = 8
    max_len: int = 2048  # KV-cache positions per slot: prompt text + text + prompt speech + generated
    schedule: ChunkSchedule = ChunkSchedule()
    # The pooled flow is exact up to this many of a segment's own frames, then keeps the latest.
    flow_context_frames: int = 700
    # Its kept block inputs as int8 codes + a scale a frame: half the pool, so twice the slots fit a
    # device, for the mel movement docs/PERF_NOTES.md measures ("The flow context in int8"). CosyVoice2.
    flow_context_int8: bool = False
    flow_encoder_tokens: int | None = None  # None: the encoder reads every token (exact); N: a window
    flow_voice_slots: int = 8  # voices whose shared prompt frames the flow pool holds
    graphs: bool = False  # CUDA only: captured decode (+ on-device sampling), prefill, flow and HiFT
    prefill_buckets: tuple[int, ...] = (128, 192, 256, 320, 384, 512)
    attend_buckets: tuple[int, ...] = (256, 512, 1024, 2048)
    # Graph buckets of the batched flow call; the largest bounds how long a new call's first chunk
    # can wait behind a call in progress (~0.3 s at 32).
    flow_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    # Render lanes for first chunks only (0: one lane renders everything); each costs its own
    # graphs. 3 kept a first chunk's wait for a lane under 15 ms at 12-14 req/s ("Three first-chunk lanes").
    first_chunk_lanes: int = 3
    flow_first_batches: tuple[int, ...] = (1, 2, 4, 8)
    # With graphs: torch.compile'd flow blocks (faster first chunks) and HiFT stages (~1.7x faster
    # vocoder). Compiled and captured once serving, on the tts-compile thread: the worker is ready
    # on graphs of the eager modules and swaps the compiled ones in (compiled_graphs_complete).
    compile_flow: bool = True
    compile_hift: bool = True
    # With graphs and Triton: decode rotary, cache write and attention by slot in one kernel per layer.
    slot_attention: bool = True
    # Graphs per captured flow solve (1: one), launched a part ahead: a whole solve's launch held its
    # lane's thread 10-55 ms and stalled the decode thread ("host stalls in CUDA calls").
    flow_solve_parts: int = 10
    # With graphs: before ready capture only each render lane's largest flow bucket (every call fits
    # it, padded) and no final-chunk HiFT shapes (eager meanwhile); the full sets come with the
    # compiled graphs (compiled_graphs_complete).
    defer_flow_graphs: bool = True
    # A later chunk whose stream has more unplayed audio than this waits, so that many streams'
    # chunks share one batched flow call (first chunks never wait).
    defer_slack_s: float = 0.8
    # Decode and render threads on CUDA streams of their own (decode at the highest priority), so a
    # decode step never queues behind a flow call. False: all on the default stream.
    separate_streams: bool = True
    # While every generating live (paced) job waits for its first chunk, decoding pauses, at most this
    # long per job (0: never), so those renders have the GPU ("decoding paused for a lone first chunk").
    first_chunk_hold_s: float = 0.3
    # While a live (paced) call waits for its first chunk, a stream more than this many seconds of
    # speech ahead of its listener skips decode steps (0: never), so that call's steps and render have
    # the GPU (runtime/step_rows.py). It must exceed `defer_slack_s` + the longest hop + lookahead (2.9 s at
    # CosyVoice2's 50-token hop), or a stream's next chunk could find its tokens missing: the scheduler raises
    # it to that for longer hops (`step_rows.yield_bound_s`; CosyVoice3's 100: 4.9 s).
    yield_lead_s: float = 4.0
    # Decode steps launched and not yet read when an iteration ends (0: each read at once); a row
    # steps up to this many times past its stop token (thrown away). 1 and 2 measured alike.
    decode_steps_ahead: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.decode_steps_ahead <= MAX_STEPS_AHEAD:
            raise ValueError(f"SchedulerSettings: decode_steps_ahead must be 0..{MAX_STEPS_AHEAD}, "
                             f"got {self.decode_steps_ahead}")
