"""FlowContextPool: the estimator's memory of earlier frames for many streams, in static device
tensors (the flow's counterpart of the LLM's static KV cache).

In streaming mode every estimator attention is chunk-causal and every convolution causal, so a
frame of a finished chunk comes out the same in every later streaming call (see `incremental.py`).
A later call therefore needs, per Euler step and guidance row, only two things from earlier frames:
- for each transformer block, the keys/values of every earlier frame. The pool keeps the block's
  *input* (the normalised hidden state, `channels` values a frame) instead and re-projects it per
  call: 4x less memory than keys + values (8 heads x 64 x 2), for one extra GEMM over the context.
  With `PoolShape.int8` each kept input is int8 codes and one fp32 scale a frame (its absolute
  maximum / 127): half the bytes again, so twice the stream slots fit a device; the keys and values
  re-projected from them move by what docs/PERF_NOTES.md measures ("The flow context in int8");
- for each causal convolution, its last `kernel - 1` input frames before the call.

Frames live in a flat frame axis: a region per stream slot (a ring of `stream_frames`), a region
per voice (the voice prompt's frames that every stream of that voice shares: computed once when the
voice is registered, never per call), and one trash frame that padded rows write to. Conv states
live per slot: stream slots, voice slots, an all-zero slot (the sequence start) and a trash slot.

A call reads and writes through `PooledStepContext` (one per Euler step), whose index tensors are
built on the device from a small per-row table, so a whole batched call is capturable in one CUDA
graph. Each layer keeps all Euler steps' memory in one tensor, rows (step, guidance half, frame or
slot) flattened, and a step's index tensors point into its share: one compiled estimator step
(torch.compile) serves every step, since nothing it reads tells steps apart but its tensor
arguments.
The pool owns no parameters and never runs the model; slot bookkeeping is host-side and belongs to
the one thread that renders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from tts_core.accel.device_memory import check_device_fits
from tts_core.flow.estimator import CausalConv1d, FlowEstimator, SelfAttention
from tts_core.flow.frame_cache import KeysValues


@dataclass(frozen=True)
class PoolShape:
    stream_slots: int
    stream_frames: int  # own frames a stream keeps exactly (a multiple of the estimator chunk)
    voice_slots: int
    voice_frames: int  # shared prompt frames a voice can hold (a multiple of the estimator chunk)
    prompt_frames: int  # prompt mel frames a voice can hold (the `cond` table)
    int8: bool = False  # kept block inputs as int8 codes + a scale a frame (half the memory; not exact)


@dataclass(frozen=True)
class CallIndex:
    """Where one batched call (B rows, C context keys, N new frames) reads and writes in the pool,
    before a step is chosen: pool rows of step 0, per guidance half (g = 0 conditioned, 1 not)."""

    ctx_frames: torch.Tensor  # (2, B, C) pool frame of each context key, + g * frames (trash for padding)
    key_pos: torch.Tensor  # (B, C+N) absolute frame position of each key, -1 for padding
    new_pos: torch.Tensor  # (B, N) absolute frame position of each new frame, -1 for padding
    ctx_count: torch.Tensor  # (B,) real context keys of each row: its first ctx_count of the C (the rest padding)
    write_frames: torch.Tensor  # (2, B, N) pool frame each new frame is kept in (trash if not kept), + g * frames
    left_src: torch.Tensor  # (2, B) conv-state slot read before the new frames, + g * slots
    left_dst: torch.Tensor  # (2, B) conv-state slot written with the state at the commit point, + g * slots
    # Per left-state width n: where the conv state at the commit point (the new frames kept) sits
    # in [left | new] (2B, 1, n), made once per call for every width the pool's convolutions have
    # (see conv_input).
    conv_at: dict[int, torch.Tensor] = field(compare=False)

    def at_step(self, pool: FlowContextPool, step: int) -> StepIndex:
        """The pool rows of Euler step `step`, for every row."""
        frames, slots = step * (2 * pool.frames), step * (2 * pool.slots)
        return StepIndex(ctx_rows=(self.ctx_frames + frames).flatten(), write_rows=(self.write_frames + frames).flatten(),
                         left_src=(self.left_src + slots).flatten(), left_dst=(self.left_dst + slots).flatten(),
                         conv_at=self.conv_at, key_pos=self.key_pos, new_pos=self.new_pos, ctx_count=self.ctx_count)


@dataclass(frozen=True)
class StepIndex:
    """A `CallIndex` at one Euler step: flat rows of the pool's per-layer tensors, [conditioned |
    unconditioned] halves of B rows each (the estimator's (2B, ...) layout)."""

    ctx_rows: torch.Tensor  # (2*B*C,)
    write_rows: torch.Tensor  # (2*B*N,)
    left_src: torch.Tensor  # (2B,)
    left_dst: torch.Tensor  # (2B,)
    # The call's, the same every step (CallIndex): what an attention kernel needs to apply the
    # chunk-causal rule itself (accel/flow_attention.py) instead of reading the additive mask.
    key_pos: torch.Tensor  # (B, C+N)
    new_pos: torch.Tensor  # (B, N)
    ctx_count: torch.Tensor  # (B,)
    conv_at: dict[int, torch.Tensor] = field(compare=False)

    @property
    def rows(self) -> int:
        """B. Read from a tensor's size, not kept as an int: symbolic under torch.compile."""
        return self.left_src.size(0) // 2


class FlowContextPool:
    def __init__(self, estimator: FlowEstimator, shape: PoolShape, steps: int, mel_bins: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        chunk = estimator.cfg.static_chunk_size
        if chunk <= 0 or shape.stream_frames % chunk or shape.voice_frames % chunk:
            raise ValueError(f"flow context pool: frame capacities must be multiples of the {chunk}-frame chunk")
        self.shape = shape
        self.chunk = chunk
        self.steps = steps
        self.frames = shape.stream_slots * shape.stream_frames + shape.voice_slots * shape.voice_frames + 1
        self.trash_frame = self.frames - 1
        slots = shape.stream_slots + shape.voice_slots + 2
        self.zero_slot, self.trash_slot = slots - 2, slots - 1
        z = dict(device=device, dtype=dtype)
        attention = [m for m in estimator.modules() if isinstance(m, SelfAttention)]
        convs = [m for m in estimator.modules() if isinstance(m, CausalConv1d)]
        self.slots = slots
        self.conv_widths = sorted({m.kernel_size[0] - 1 for m in convs})
        # Per SelfAttention: block inputs, rows (step, g, frame); per CausalConv1d: input states,
        # rows (step, g, slot). Step k's rows start at k * 2 * frames (slots): CallIndex.at_step.
        rows = steps * 2 * self.frames
        hidden = {m: (rows, m.to_q.in_features) for m in attention}
        left = {m: (steps * 2 * slots, m.in_channels, m.kernel_size[0] - 1) for m in convs}
        # Per voice: prompt mel rows (the last row stays zero: frames past the prompt) and speaker.
        cond, spks = (shape.voice_slots * shape.prompt_frames + 1, mel_bins), (shape.voice_slots, mel_bins)
        element = torch.empty(0, dtype=dtype).element_size()
        kept_bytes = sum(math.prod(size) for size in hidden.values())
        kept_bytes = kept_bytes + len(hidden) * rows * 4 if shape.int8 else kept_bytes * element
        self.planned_bytes = kept_bytes + element * sum(math.prod(size) for size in (*left.values(), cond, spks))
        check_device_fits("the CosyVoice2 flow context pool", self.planned_bytes, device)
        kept_dtype = torch.int8 if shape.int8 else dtype
        self.hidden = {m: torch.zeros(size, device=device, dtype=kept_dtype) for m, size in hidden.items()}
        # Per SelfAttention with int8: each kept row's scale (rows, 1), fp32 (a bf16 scale would move a
        # whole frame by up to 0.4 %).
        self.scales = ({m: torch.zeros(rows, 1, device=device, dtype=torch.float32) for m in attention}
                       if shape.int8 else {})
        self.left = {m: torch.zeros(size, **z) for m, size in left.items()}
        self.cond = torch.zeros(cond, **z)
        self.spks = torch.zeros(spks, **z)
        self._free_streams = list(range(shape.stream_slots))
        self._free_voices = list(range(shape.voice_slots))

    def nbytes(self) -> int:
        tensors = [*self.hidden.values(), *self.scales.values(), *self.left.values(), self.cond, self.spks]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- slots (host side) -------------------------------------------------------------------
    def take_stream(self) -> int:
        if not self._free_streams:
            raise RuntimeError(f"flow context pool: all {self.shape.stream_slots} stream slots are in use")
        return self._free_streams.pop()

    def give_back_stream(self, slot: int) -> None:
        self._free_streams.append(slot)

    @property
    def free_streams(self) -> int:
        return len(self._free_streams)

    def take_voice(self) -> int:
        if not self._free_voices:
            raise RuntimeError(f"flow context pool: all {self.shape.voice_slots} voice slots are in use")
        return self._free_voices.pop(0)

    def stream_frame_base(self, slot: int) -> int:
        return slot * self.shape.stream_frames

    def voice_frame_base(self, voice: int) -> int:
        return self.shape.stream_slots * self.shape.stream_frames + voice * self.shape.voice_frames

    def voice_conv_slot(self, voice: int) -> int:
        return self.shape.stream_slots + voice

    def cond_row(self, voice: int) -> int:
        return voice * self.shape.prompt_frames

    @property
    def zero_cond_row(self) -> int:
        return self.cond.size(0) - 1


class PooledStepContext:
    """The pool seen by one Euler step of one batched call: rows are [conditioned | unconditioned],
    B each, in the estimator's (2B, ...) layout. Reads happen before writes in every layer, so a
    ring slot overwritten by this call is still read with its old content."""

    def __init__(self, pool: FlowContextPool, index: StepIndex) -> None:
        self.pool, self.index = pool, index

    def conv_input(self, layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.conv(layer).conv_input(layer, x, n)

    def attention_keys_values(self, layer: nn.Module, x: torch.Tensor,
                              project: KeysValues) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention(layer).attention_keys_values(layer, x, project)

    # One layer's share, without the layer: a compiled module given its layers' shares serves every
    # module of its shape (estimator.Regions, accel/flow_pool_graphs).
    def conv(self, layer: nn.Module) -> ConvContext:
        return ConvContext(self.pool.left[layer], self.index)

    def attention(self, layer: nn.Module) -> AttentionContext:
        return AttentionContext(self.pool.hidden[layer], self.pool.scales.get(layer), self.index)


@dataclass(frozen=True)
class ConvContext:
    """One causal convolution's share of a `PooledStepContext`: its input states (steps*2*slots, C, n)."""

    states: torch.Tensor
    index: StepIndex

    def conv_input(self, layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        left = self.states.index_select(0, self.index.left_src)
        seq = torch.cat([left, x], dim=2)
        # The n input frames before the commit point: seq[commit : commit + n] (seq has n left frames).
        kept = seq.gather(2, self.index.conv_at[n].expand(-1, x.size(1), -1))
        self.states.index_copy_(0, self.index.left_dst, kept)
        return seq


@dataclass(frozen=True)
class AttentionContext:
    """One attention layer's share of a `PooledStepContext`: its block inputs (steps*2*frames, D), as
    values of the model's dtype, or as int8 codes with a scale a row (`scales`, (steps*2*frames, 1))."""

    hidden: torch.Tensor
    scales: torch.Tensor | None
    index: StepIndex

    def context_inputs(self, dtype: torch.dtype) -> torch.Tensor:
        """The call's context rows of block inputs (2*B*C, D) in `dtype`."""
        kept = self.hidden.index_select(0, self.index.ctx_rows)
        if self.scales is None:
            return kept
        return (kept.float() * self.scales.index_select(0, self.index.ctx_rows)).to(dtype)

    def to_kept(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """What `write` keeps of new frames' block inputs y (2*B*N, D): (y,), or (codes, scales) with int8.
        Symmetric, a scale a frame: its largest magnitude maps to 127, an all-zero frame to codes 0.
        Made where y is made (the compiled half that normalises it: no pass of its own), written after the
        attention."""
        if self.scales is None:
            return (y,)
        y = y.float()
        scale = y.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
        return torch.round(y / scale).to(torch.int8), scale

    def write(self, kept: tuple[torch.Tensor, ...]) -> None:
        """Keep `to_kept`'s tensors at the call's write rows."""
        rows = self.index.write_rows
        self.hidden.index_copy_(0, rows, kept[0])
        if self.scales is not None:
            self.scales.index_copy_(0, rows, kept[1])

    def keep(self, y: torch.Tensor) -> None:
        """Keep the new frames' block inputs y (2*B*N, D) at the call's write rows."""
        self.write(self.to_kept(y))

    def attention_keys_values(self, layer: nn.Module, x: torch.Tensor,
                              project: KeysValues) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, d = self.index.rows, x.size(1), x.size(2)
        context = self.context_inputs(x.dtype).view(2 * b, -1, d)
        keys_values = project(torch.cat([context, x], dim=1))
        # Written only after the last use of what was read. Compiled (compile_flow), a write placed
        # between the read and its use made inductor read the old frames after the write, which
        # it can only do from a copy of this layer's whole pool: 56 copies per Euler step, 102 ms
        # of flow solve on the H100 where the eager step takes 43
        # (docs/PERF_NOTES.md, "The per-module compiled flow").
        self.keep(x.reshape(2 * b * n, d))
        return keys_values
