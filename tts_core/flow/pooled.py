"""Chunk-wise streaming flow for many streams at once, each frame computed once (exact).

A stream's call renders its new frames [committed, end) only; everything earlier comes from the
`FlowContextPool`: the voice prompt's shared frames (computed once per voice by `register_voice`)
and the stream's own finished chunks. The estimator sees, per Euler step, the new frames' inputs
and re-projects the pooled hidden states of the context into keys/values, which is the official
full re-run's arithmetic restricted to the frames it keeps (equal to the golden streaming mels,
tests/tts_core/test_flow_pooled.py). Work per call is the new frames' network plus one key/value
projection and one attention over the context, instead of the whole network over the whole
utterance.

Why the voice prefix can be shared: the encoder's pre-lookahead convolution lets a prompt token see
the next `pre_lookahead_len` tokens, so the prompt's last chunk depends on what the stream says.
Every chunk that ends at least `pre_lookahead_len` tokens before the prompt's end does not, and
neither do its estimator frames (chunk-causal attention, causal convolutions, fixed noise).

The encoder (cheap: once per call, not per Euler step) reads the tokens from a window start on:
the prompt's first token by default (exact), or `encoder_tokens` before the new ones (static call
shapes for graphs; measured in bench/bench_flow_pooled.py).

A stream whose own frames outgrow `PoolShape.stream_frames` keeps its latest frames (whole chunks):
only then does it see less than the official call (logged once per stream).

`pooled_solve` is capturable (no host syncs), also cut into parts (`SolveParts`);
`PooledFlow.render` is the eager driver, and `tts_core.accel.flow_pool_graphs` replays captured
calls. One thread drives a `PooledFlow`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog
import torch

from tts_core.flow.context_pool import CallIndex, FlowContextPool, PooledStepContext, PoolShape, StepIndex
from tts_core.flow.model import FlowModel
from tts_core.flow.sampler import euler_times
from tts_core.flow.encoder_window import encode_grouped, encode_new_frames

log = structlog.get_logger(__name__)

# Columns of the per-row table a call is built from (host ints -> one device tensor).
ROW_FIELDS = ("voice_base", "prefix", "own_base", "ctx_first", "ctx_len", "start", "new", "commit",
              "write_first", "ring", "left_src", "left_dst", "cond_row", "prompt_frames", "voice")
COL = {name: i for i, name in enumerate(ROW_FIELDS)}


@dataclass(frozen=True)
class VoicePrefix:
    """A registered voice: its slot, prompt, and how many prompt frames all its streams share."""

    slot: int
    prompt_token: torch.Tensor  # (1, P) long, on the device
    prompt_frames: int  # P * token_mel_ratio
    prefix_frames: int  # shared frames [0, prefix_frames), a multiple of the estimator chunk


@dataclass
class PooledStream:
    """One request's flow state: host ints only (its frames live in the pool)."""

    voice: VoicePrefix
    slot: int
    committed: int  # absolute frames [0, committed) are final and pooled
    emitted: int  # absolute frames returned so far (the prompt counts as returned)
    finished: bool = False
    slid: bool = False  # own frames outgrew the pool's ring once (logged)


@dataclass(frozen=True)
class PooledPlan:
    """One row of a call (made by `PooledFlow.plan`); an `encoder_window.EncoderCall`."""

    row: tuple[int, ...]  # ROW_FIELDS values
    enc_tokens: torch.Tensor  # (1, n) all-token ids the encoder reads
    finalize: bool
    start: int
    end: int
    commit: int

    @property
    def new_frames(self) -> int:
        return self.end - self.start

    @property
    def ctx_frames(self) -> int:
        return self.row[COL["prefix"]] + self.row[COL["ctx_len"]]


def call_index(pool: FlowContextPool, table: torch.Tensor, ctx_cap: int, new_cap: int) -> CallIndex:
    """table (B, len(ROW_FIELDS)) long on the device -> the call's index tensors (capturable)."""
    dev = table.device
    col = {name: table[:, i:i + 1] for name, i in COL.items()}  # (B, 1) each
    j = torch.arange(ctx_cap, device=dev).unsqueeze(0)
    in_prefix = j < col["prefix"]
    own = j - col["prefix"]
    in_own = (own >= 0) & (own < col["ctx_len"])
    own_at = col["ctx_first"] + own
    ctx_frames = torch.where(in_prefix, col["voice_base"] + j,
                             torch.where(in_own, col["own_base"] + own_at % col["ring"], pool.trash_frame))
    ctx_pos = torch.where(in_prefix, j, torch.where(in_own, col["prefix"] + own_at, -1))
    i = torch.arange(new_cap, device=dev).unsqueeze(0)
    new_pos = torch.where(i < col["new"], col["start"] + i, -1)
    write = torch.where(i < col["commit"], col["own_base"] + (col["write_first"] + i) % col["ring"],
                        pool.trash_frame)
    commit = col["commit"].view(-1, 1, 1)
    commit = torch.cat([commit, commit])
    halves = torch.arange(2, device=dev)
    frame_half, slot_half = (halves * pool.frames).view(2, 1, 1), (halves * pool.slots).view(2, 1)
    ctx_count = (col["prefix"] + col["ctx_len"]).clamp(max=ctx_cap).flatten()
    return CallIndex(ctx_frames=ctx_frames + frame_half, key_pos=torch.cat([ctx_pos, new_pos], 1),
                     new_pos=new_pos, ctx_count=ctx_count, write_frames=write + frame_half,
                     left_src=table[:, COL["left_src"]] + slot_half, left_dst=table[:, COL["left_dst"]] + slot_half,
                     conv_at={n: commit + torch.arange(n, device=dev) for n in pool.conv_widths})


def attention_mask(index: CallIndex, chunk: int, left_chunks: int) -> torch.Tensor:
    """(2B, 1, N, C+N) bool: the chunk-causal rule on absolute positions; padding keys hidden; a
    padded query sees only its own key (an all-False row would make softmax NaN)."""
    q, k = index.new_pos.unsqueeze(2), index.key_pos.unsqueeze(1)
    cq, ck = torch.div(q, chunk, rounding_mode="floor"), torch.div(k, chunk, rounding_mode="floor")
    ok = (q >= 0) & (k >= 0) & (ck <= cq)
    if left_chunks >= 0:
        ok &= ck >= cq - left_chunks
    n, total = q.size(1), k.size(2)
    own_key = torch.arange(total - n, total, device=q.device).unsqueeze(1) == torch.arange(total, device=q.device)
    ok |= (q < 0) & own_key
    ok = ok.unsqueeze(1)
    return torch.cat([ok, ok])


def additive_mask(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool (..., K) -> the same mask as 0 / -inf in `dtype`, each row 16-element aligned in memory.
    Given a bool mask, scaled_dot_product_attention converts it (and the memory-efficient kernel pads
    unaligned rows) in every call: 56 blocks x 10 steps per flow call. Converted once here instead;
    the attention is the same."""
    keys = ok.size(-1)
    return aligned_mask_buffer(ok.shape[:-1], keys, dtype, ok.device)[..., :keys].masked_fill_(ok, 0.0)


def aligned_mask_buffer(lead: Sequence[int], keys: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """(*lead, K') all -inf, K' = `keys` rounded up to 16: an additive mask's storage, whose
    [..., :keys] view has 16-element aligned rows (`additive_mask`)."""
    return torch.full((*lead, -(-keys // 16) * 16), float("-inf"), dtype=dtype, device=device)


@dataclass(frozen=True)
class EulerStep:
    """One step of the solver with what depends only on its time, made once per model (`euler_steps`)."""

    dt: torch.Tensor  # 0-d, the step's width
    time_biases: tuple[torch.Tensor, ...]  # (1, channels) per estimator resnet: FlowEstimator.time_biases(t)


@torch.no_grad()
def euler_steps(model: FlowModel) -> tuple[EulerStep, ...]:
    """The solver's steps for `model` as loaded (its weights must not change afterwards)."""
    sampler = model.decoder
    weight = model.input_embedding.weight
    return tuple(EulerStep(dt, tuple(sampler.estimator.time_biases(t)))
                 for t, dt in euler_times(sampler.n_timesteps, sampler.scheduler, weight.device, weight.dtype))


@dataclass(frozen=True)
class SolveInputs:
    """What every Euler step of a batched call reads besides x; made once per call (capturable)."""

    index: CallIndex
    x0: torch.Tensor  # (B, 80, N) the starting noise, zero past each row's new frames
    mu: torch.Tensor  # (2B, 80, N) [conditioned | unconditioned], likewise cond; spks (2B, 80)
    cond: torch.Tensor
    spks: torch.Tensor
    attn: torch.Tensor  # additive attention mask (2B, 1, N, C+N)


def solve_inputs(model: FlowModel, pool: FlowContextPool, table: torch.Tensor, mu: torch.Tensor,
                 ctx_cap: int) -> SolveInputs:
    """table (B, fields) long, mu (B, 80, N) -> the call's inputs to its Euler steps."""
    sampler = model.decoder
    est = sampler.estimator
    rows, new_cap, dtype = mu.size(0), mu.size(2), mu.dtype
    index = call_index(pool, table, ctx_cap, new_cap)
    valid = index.new_pos >= 0
    frame_mask = valid.to(dtype).unsqueeze(1)  # (B, 1, N)
    pos = index.new_pos.clamp(min=0)
    noise = sampler.rand_noise[0].index_select(1, pos.flatten()).view(-1, rows, new_cap).transpose(0, 1)
    in_prompt = valid & (index.new_pos < table[:, COL["prompt_frames"]].unsqueeze(1))
    cond_rows = torch.where(in_prompt, table[:, COL["cond_row"]].unsqueeze(1) + pos, pool.zero_cond_row)
    cond = pool.cond.index_select(0, cond_rows.flatten()).view(rows, new_cap, -1).transpose(1, 2)
    spks = pool.spks.index_select(0, table[:, COL["voice"]])
    attn = additive_mask(attention_mask(index, est.cfg.static_chunk_size, est.cfg.num_decoding_left_chunks), dtype)
    zeros = torch.zeros_like(mu)
    return SolveInputs(index, noise.to(dtype) * frame_mask, torch.cat([mu * frame_mask, zeros]),
                       torch.cat([cond, zeros]), torch.cat([spks, torch.zeros_like(spks)]), attn)


def _euler_step(model: FlowModel, pool: FlowContextPool, inputs: SolveInputs, x: torch.Tensor, at: StepIndex,
                time_biases: Sequence[torch.Tensor], dt: torch.Tensor, estimator: Callable) -> torch.Tensor:
    sampler = model.decoder
    rows = x.size(0)
    # No frame mask: padding frames never reach valid ones and are dropped (FlowEstimator.forward).
    v = estimator(torch.cat([x, x]), None, inputs.mu, None, inputs.spks, inputs.cond, inputs.attn,
                  PooledStepContext(pool, at), time_biases)
    return x + dt * ((1.0 + sampler.cfg_rate) * v[:rows] - sampler.cfg_rate * v[rows:])


def pooled_solve(model: FlowModel, pool: FlowContextPool, table: torch.Tensor, mu: torch.Tensor,
                 ctx_cap: int, steps: Sequence[EulerStep], estimator: Callable | None = None) -> torch.Tensor:
    """The 10 guided Euler steps over the new frames of a batch: table (B, fields) long, mu (B, 80,
    N) -> mel (B, 80, N) float32. Reads the rows' context from the pool and writes their kept frames
    back. No host syncs: capturable. `steps`: `euler_steps(model)`; `estimator`: the model's
    estimator or a compiled version of it (accel/flow_pool_graphs)."""
    return SolveParts(model, pool, table, mu, ctx_cap, steps, estimator, parts=1).run(0)


class SolveParts:
    """`pooled_solve` cut at Euler-step boundaries into `parts` calls that must run in order, each
    reading what the one before left (`x`, and the inputs part 0 makes): so that a captured solve
    can be several graphs, each launched when the GPU is ready for it (accel/flow_pool_graphs).
    The last part returns the mel. Capturable, like `pooled_solve`."""

    def __init__(self, model: FlowModel, pool: FlowContextPool, table: torch.Tensor, mu: torch.Tensor,
                 ctx_cap: int, steps: Sequence[EulerStep], estimator: Callable | None, parts: int) -> None:
        if not 1 <= parts <= len(steps):
            raise ValueError(f"a solve of {len(steps)} Euler steps cannot be cut into {parts} parts")
        self.model, self.pool, self.table, self.mu, self.ctx_cap, self.steps = model, pool, table, mu, ctx_cap, steps
        self.estimator = model.decoder.estimator if estimator is None else estimator
        # Part k runs steps [bounds[k], bounds[k + 1]).
        self.bounds = [len(steps) * k // parts for k in range(parts + 1)]
        self.inputs: SolveInputs | None = None
        self.x: torch.Tensor | None = None

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def run(self, part: int) -> torch.Tensor:
        """Run one part: x after its last step (the mel, float32, after the last part)."""
        if part == 0:
            self.inputs = solve_inputs(self.model, self.pool, self.table, self.mu, self.ctx_cap)
            self.x = self.inputs.x0
        inputs = self.inputs
        for k in range(self.bounds[part], self.bounds[part + 1]):
            step = self.steps[k]
            self.x = _euler_step(self.model, self.pool, inputs, self.x, inputs.index.at_step(self.pool, k),
                                 step.time_biases, step.dt, self.estimator)
        if part < self.parts - 1:
            return self.x
        mel = self.x.float()
        self.inputs = self.x = None  # a solve's state lives from its first part to its last
        return mel


class PooledFlow:
    """Streams of registered voices, rendered in batches from one `FlowContextPool` (eager)."""

    def __init__(self, model: FlowModel, shape: PoolShape, encoder_tokens: int | None = None) -> None:
        cfg = model.cfg
        param = model.input_embedding.weight
        self.model = model
        self.device, self.dtype = param.device, param.dtype
        self.ratio, self.lookahead = cfg.token_mel_ratio, cfg.pre_lookahead_len
        self.token_chunk = cfg.encoder.static_chunk_size
        self.chunk = cfg.estimator.static_chunk_size
        if self.token_chunk <= 0 or self.chunk != self.token_chunk * self.ratio:
            raise ValueError("pooled flow: encoder and estimator chunks must cover the same frames")
        self.encoder_tokens = encoder_tokens
        self.pool = FlowContextPool(model.decoder.estimator, shape, cfg.n_timesteps, cfg.output_size,
                                    self.device, self.dtype)
        self.steps = euler_steps(model)

    # ---- voices and streams (host side) ----------------------------------------------------------
    @torch.inference_mode()
    def register_voice(self, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                       embedding: torch.Tensor) -> VoicePrefix:
        """prompt_token (1, P), prompt_feat (1, P * ratio, 80), embedding (1, 192): computes the
        frames all streams of this voice share, once."""
        p = prompt_token.size(1)
        prompt_frames = p * self.ratio
        shape = self.pool.shape
        if prompt_feat.size(1) != prompt_frames:
            raise ValueError(f"pooled flow: prompt mel has {prompt_feat.size(1)} frames, tokens need {prompt_frames}")
        if prompt_frames > shape.prompt_frames:
            raise ValueError(f"pooled flow: a {prompt_frames}-frame prompt exceeds the pool's {shape.prompt_frames}")
        shared_tokens = max(0, p - self.lookahead) // self.token_chunk * self.token_chunk
        prefix = min(shared_tokens * self.ratio, shape.voice_frames)
        slot = self.pool.take_voice()
        token = prompt_token.to(self.device, torch.long)
        row = self.pool.cond_row(slot)
        self.pool.cond[row:row + prompt_frames] = prompt_feat[0].to(self.device, self.dtype)
        self.pool.spks[slot] = self.model.speaker(embedding.to(self.device, self.dtype))[0]
        voice = VoicePrefix(slot, token, prompt_frames, prefix)
        if prefix:
            base = self.pool.voice_frame_base(slot)
            table = self.table([self._row(voice, base, 0, base, 0, 0, 0, prefix, prefix, 0, shape.voice_frames,
                                           self.pool.zero_slot, self.pool.voice_conv_slot(slot))])
            mu = encode_new_frames(self.model, token, True, prompt_frames)[:, :, :prefix]
            pooled_solve(self.model, self.pool, table, mu, 0, self.steps)
        log.info("flow_voice_registered", slot=slot, prompt_frames=prompt_frames, shared_frames=prefix)
        return voice

    def open_stream(self, voice: VoicePrefix) -> PooledStream:
        return PooledStream(voice, self.pool.take_stream(), committed=voice.prefix_frames, emitted=voice.prompt_frames)

    def close_stream(self, stream: PooledStream) -> None:
        """Give the stream's slot back (idempotent); its pooled frames are simply overwritten later."""
        if stream.slot >= 0:
            self.pool.give_back_stream(stream.slot)
            stream.slot = -1

    # ---- one call ------------------------------------------------------------------------------
    def window_start(self, start: int) -> int:
        """The first token (of prompt + stream) the encoder reads for a call that renders from frame `start`."""
        if self.encoder_tokens is None:
            return 0
        return max(0, (start // self.ratio - self.encoder_tokens) // self.token_chunk * self.token_chunk)

    def call_shape(self, voice: VoicePrefix, hops: Sequence[int]) -> tuple[int, int]:
        """(tokens the encoder reads, frames rendered) of a stream's non-final call number len(hops), each
        call rendering its hop of tokens + the lookahead: the shape `plan` gives that call, for capturing its
        encoder graph ahead (a first hop off the chunk grid gives the first two calls windows of their own)."""
        prompt = voice.prompt_token.size(1)
        start, end_tok = voice.prefix_frames, prompt
        for hop in hops[:-1]:
            end_tok += hop
            start = end_tok // self.token_chunk * self.token_chunk * self.ratio  # what plan commits
        end_tok += hops[-1]
        tokens = end_tok + self.lookahead - self.window_start(start)
        return tokens, end_tok * self.ratio - start

    def plan(self, stream: PooledStream, tokens: torch.Tensor, finalize: bool) -> PooledPlan:
        """tokens (1, N): every speech token of the stream so far (as the official streaming call
        gets them); a non-final call's last `pre_lookahead_len` tokens are lookahead only."""
        if stream.finished or stream.slot < 0:
            raise RuntimeError("pooled flow: render on a finished or closed stream")
        voice, pool = stream.voice, self.pool
        all_tokens = torch.cat([voice.prompt_token, tokens.to(self.device, torch.long)], dim=1)
        end_tok = all_tokens.size(1) if finalize else all_tokens.size(1) - self.lookahead
        start, end = stream.committed, end_tok * self.ratio
        if end <= start or end < stream.emitted:
            raise ValueError(f"pooled flow: {tokens.size(1)} tokens is fewer than already rendered")
        # A final call keeps nothing (the stream ends); others keep whole chunks only.
        commit = start if finalize else end_tok // self.token_chunk * self.token_chunk * self.ratio
        enc_start = self.window_start(start)
        own = start - voice.prefix_frames
        ring = pool.shape.stream_frames
        ctx_len = min(own, ring)
        if ctx_len < own and not stream.slid:
            stream.slid = True
            # The configured trade (flow_context_s), not a fault: every segment longer than it passes here.
            log.info("flow_context_slid", kept_frames=ring, own_frames=own)
        left_src = stream.slot if own > 0 else (
            pool.voice_conv_slot(voice.slot) if voice.prefix_frames else pool.zero_slot)
        left_dst = stream.slot if commit > start else pool.trash_slot
        row = self._row(voice, pool.voice_frame_base(voice.slot), voice.prefix_frames,
                        pool.stream_frame_base(stream.slot), own - ctx_len, ctx_len, start, end - start,
                        commit - start, own, ring, left_src, left_dst)
        return PooledPlan(row, all_tokens[:, enc_start:], finalize, start, end, commit)

    def finish(self, stream: PooledStream, plan: PooledPlan, mel: torch.Tensor) -> torch.Tensor:
        """After the call: mel (1, 80, new frames) -> the frames not returned before."""
        out = mel[:, :, stream.emitted - plan.start:]
        stream.committed = plan.commit
        stream.emitted = plan.end
        stream.finished = plan.finalize
        return out

    @torch.inference_mode()
    def render(self, streams: Sequence[PooledStream], tokens: Sequence[torch.Tensor],
               finalize: Sequence[bool]) -> list[torch.Tensor]:
        """One eager batched call: mel (1, 80, new) float32 per stream, in order."""
        plans = [self.plan(s, t, f) for s, t, f in zip(streams, tokens, finalize)]
        mel = self.solve(plans, encode_grouped(self.model, plans))
        return [self.finish(s, p, mel[i:i + 1, :, :p.new_frames]) for i, (s, p) in enumerate(zip(streams, plans))]

    def solve(self, plans: Sequence[PooledPlan], mus: Sequence[torch.Tensor]) -> torch.Tensor:
        """The eager solve of planned rows with their mu (80, n_i) -> mel (rows, 80, widest new)."""
        new_cap = max(p.new_frames for p in plans)
        return pooled_solve(self.model, self.pool, self.table([p.row for p in plans]),
                            self.stack_mu(mus, len(plans), new_cap), max(p.ctx_frames for p in plans), self.steps)

    def stack_mu(self, mus: Sequence[torch.Tensor], rows: int, new_cap: int) -> torch.Tensor:
        """mu (80, n_i) per row -> (rows, 80, new_cap), zero padded."""
        out = torch.zeros(rows, mus[0].size(0), new_cap, device=self.device, dtype=self.dtype)
        for i, mu in enumerate(mus):
            out[i, :, :mu.size(1)] = mu
        return out

    def _row(self, voice: VoicePrefix, voice_base: int, prefix: int, own_base: int, ctx_first: int, ctx_len: int,
             start: int, new: int, commit: int, write_first: int, ring: int, left_src: int,
             left_dst: int) -> tuple[int, ...]:
        return (voice_base, prefix, own_base, ctx_first, ctx_len, start, new, commit, write_first, ring, left_src,
                left_dst, self.pool.cond_row(voice.slot), voice.prompt_frames, voice.slot)

    def padding_row(self) -> tuple[int, ...]:
        """A row that reads nothing and writes only to the trash (fills a graph's unused rows)."""
        p = self.pool
        return (p.trash_frame, 0, p.trash_frame, 0, 0, 0, 0, 0, 0, 1, p.zero_slot, p.trash_slot,
                p.zero_cond_row, 0, 0)

    def table(self, rows: Sequence[tuple[int, ...]]) -> torch.Tensor:
        """Rows of ROW_FIELDS values (`PooledPlan.row`, `padding_row`) -> the device table."""
        return torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
