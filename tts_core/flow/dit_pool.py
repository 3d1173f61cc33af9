"""DiTContextPool: CosyVoice3's DiT memory of earlier frames for many streams, so that a streaming
chunk renders only its new frames (CosyVoice2's `context_pool.py` for the DiT estimator).

In streaming mode the DiT's attention is chunk-causal (chunks of `static_chunk_size` frames counted
from the prompt's first frame, all left chunks visible) and its position convolutions are causal, so
a frame of a finished chunk comes out the same in every later streaming call (golden README:
`stream_calls` chunks 1-2 equal `mel_stream_full`). A later call needs, per Euler step and guidance
row, only:
- per block, the rotated keys and the values of every earlier frame (kept here: K and V rather than
  CosyVoice2's re-projected block inputs, because re-projecting a DiT context of C frames costs
  ~4.2 MFLOP a frame per layer against ~17 for a new frame: more than the new frames once C > 4 N);
- per position convolution (two, kernel 31), its input at the 30 frames before the call: the pool
  keeps both convolutions' inputs for every kept frame (2 x dim, ~4 % of the K/V).

One frame costs steps x 2 rows x (depth x 2 x heads x dim_head + 2 dim) values: 10 x 2 x (22 x 2048 +
2048) x 2 bytes = 1.88 MB in bf16 at full size (`frame_bytes`).

Frames live on one flat frame axis: per voice the prompt frames every stream of that voice shares
(the complete chunks before the first frame whose mu the stream's own tokens reach through the
pre-lookahead convolution; computed once when the voice is added), per stream slot a ring of
`stream_frames` own frames, one all-zero frame (before the sequence start) and one trash frame
(padding and unkept frames write there). A stream keeps its latest `stream_frames` own frames,
those a call writes included: exact while a segment's own frames fit, beyond that each chunk sees
the voice prompt and the segment's latest frames only (as CosyVoice2's `flow_context_frames`).

Only complete chunks are kept: a call renders from the stream's last chunk boundary (recomputing an
unfinished chunk's frames, which will see more keys once the chunk fills) and keeps frames up to the
last boundary it reaches. The official schedule (prompt + first hop a multiple of the chunk, then
multiples of it) starts and ends every non-final call on a boundary, so nothing is recomputed.

Bookkeeping is host-side: a slot's counts belong to the thread rendering that slot's stream (a
stream is rendered by one lane at a time), voices are added under the renderer's voice lock; calls
of several lanes touch disjoint frames (all may write the trash frame, which nothing reads). A call's
device work reads only index tables built on the host before it (`table`, one copy over), so each
batch bucket (rows, context frames, new frames) is one CUDA graph (tts_core/accel/dit_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tts_core.accel.device_memory import check_device_fits
from torch.nn import functional as F

from tts_core.flow.dit import POS_CONV_KERNEL, DiTEstimator, _norm
from tts_core.flow.sampler import FlowSampler, euler_times

LEFT = POS_CONV_KERNEL - 1  # frames of left context each position convolution reads


@dataclass(frozen=True)
class DiTRow:
    """One stream's share of a batched call: compute frames [start, end) (absolute, from the prompt's
    first frame) seeing `context` (pool frames of every earlier kept frame), keep frames
    [start, start + len(keep)) at the pool frames `keep` (the trash frame for any beyond the window),
    reading the position convolutions' left context from `left` (LEFT pool frames: those of frames
    start-30 .. start-1, the zero frame before 0)."""

    start: int
    end: int
    context: list[int]
    keep: list[int]
    left: list[int]


@dataclass(frozen=True)
class DiTTables:
    """A solve's index tables on the device, packed as `DiTContextPool.table` packs them."""

    packed: torch.Tensor  # int64, flat
    rows: int
    ctx_frames: int
    new_frames: int

    def unpack(self) -> tuple[torch.Tensor, ...]:
        """(context (B, C), context valid (B, C) bool, write (B, N), left (B, LEFT), starts (B), lengths (B))."""
        b, c, n = self.rows, self.ctx_frames, self.new_frames
        ctx, ok, write, left, starts, lengths = self.packed.split([b * c, b * c, b * n, b * LEFT, b, b])
        return ctx.view(b, c), ok.view(b, c).bool(), write.view(b, n), left.view(b, LEFT), starts, lengths


@dataclass
class _Voice:
    offset: int  # first pool frame of its shared prompt frames
    frames: int  # shared prompt frames (complete chunks)


def frame_bytes(estimator: DiTEstimator, steps: int, element_bytes: int) -> int:
    """Pool bytes one kept frame costs (all Euler steps, both guidance rows)."""
    cfg = estimator.cfg
    return steps * 2 * (cfg.depth * 2 * cfg.heads * cfg.dim_head + 2 * cfg.dim) * element_bytes


def shared_prompt_frames(prompt_frames: int, prompt_tokens: int, token_mel_ratio: int, lookahead: int,
                         chunk: int) -> int:
    """Frames of a voice prompt that every stream renders the same: the complete chunks before the first
    frame whose mu depends on the stream's tokens (the last `lookahead` prompt tokens see them)."""
    if prompt_frames != prompt_tokens * token_mel_ratio:
        raise ValueError(f"prompt mel has {prompt_frames} frames, its {prompt_tokens} tokens need "
                         f"{prompt_tokens * token_mel_ratio}")
    independent = max(0, prompt_frames - token_mel_ratio * lookahead)
    return independent // chunk * chunk


class DiTContextPool:
    def __init__(self, sampler: FlowSampler, stream_slots: int, stream_frames: int, voice_frames: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        est = sampler.estimator
        if not isinstance(est, DiTEstimator):
            raise TypeError("DiTContextPool needs a DiT estimator")
        self.sampler, self.est = sampler, est
        cfg = est.cfg
        self.chunk = cfg.static_chunk_size
        if self.chunk <= 0 or cfg.num_decoding_left_chunks >= 0:
            raise ValueError("the DiT pool needs chunk-causal attention over all left chunks "
                             f"(static_chunk_size {cfg.static_chunk_size}, left chunks {cfg.num_decoding_left_chunks})")
        if stream_frames < self.chunk or stream_frames % self.chunk:
            raise ValueError(f"stream_frames {stream_frames} must be a positive multiple of the chunk ({self.chunk})")
        self.steps = sampler.n_timesteps
        self.stream_slots, self.stream_frames, self.voice_capacity = stream_slots, stream_frames, voice_frames
        self.inner = cfg.heads * cfg.dim_head
        base = voice_frames
        self._stream_base = base
        self.zero = base + stream_slots * stream_frames
        self.trash = self.zero + 1
        self.total_frames = self.trash + 1
        self.planned_bytes = self.total_frames * frame_bytes(est, self.steps, torch.empty(0, dtype=dtype).element_size())
        check_device_fits("the CosyVoice3 DiT context pool", self.planned_bytes, device)
        # (layer, step, guidance row, k|v, frame, channels) and (step, guidance row, conv 1|2, frame, dim)
        self.kv = torch.zeros(cfg.depth, self.steps, 2, 2, self.total_frames, self.inner, device=device, dtype=dtype)
        self.pos = torch.zeros(self.steps, 2, 2, self.total_frames, cfg.dim, device=device, dtype=dtype)
        self.device, self.dtype = device, dtype
        self._constants = _StepConstants.of(sampler, est, device, dtype)
        self._voices: dict[object, _Voice] = {}
        self._voice_used = 0
        self.own = [0] * stream_slots  # own frames kept so far (from the voice's shared frames on)
        self.voice_of: list[_Voice | None] = [None] * stream_slots

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size() + self.pos.numel() * self.pos.element_size()

    # --- voices -----------------------------------------------------------------------------------
    def has_voice(self, key: object) -> bool:
        return key in self._voices

    def shared_frames(self, key: object) -> int:
        """The voice's shared prompt frames (the context of its streams' first calls)."""
        return self._voices[key].frames

    def add_voice(self, key: object, frames: int, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> None:
        """Render and keep a voice's shared prompt frames [0, frames) (mu, cond (1, 80, >= frames), spks
        (1, 80)); every stream of `key` then starts from them. Space is never given back: a changed voice
        is added again under a new key (stale ones stay until the pool is rebuilt)."""
        if frames % self.chunk:
            raise ValueError(f"shared prompt frames {frames} must be whole chunks of {self.chunk}")
        if self._voice_used + frames > self.voice_capacity:
            raise ValueError(f"the DiT pool holds {self.voice_capacity} shared prompt frames; voice needs "
                             f"{frames} more than the {self.voice_capacity - self._voice_used} left")
        voice = _Voice(self._voice_used, frames)
        if frames:
            keep = list(range(voice.offset, voice.offset + frames))
            row = DiTRow(0, frames, [], keep, [self.zero] * LEFT)
            self.solve([row], mu[:, :, :frames], cond[:, :, :frames], spks)
        self._voice_used += frames
        self._voices[key] = voice

    @property
    def voice_frames_left(self) -> int:
        return self.voice_capacity - self._voice_used

    # --- stream slots -----------------------------------------------------------------------------
    def start_stream(self, slot: int, voice_key: object) -> None:
        self.own[slot] = 0
        self.voice_of[slot] = self._voices[voice_key]

    def kept_until(self, slot: int) -> int:
        """Absolute frame up to which the stream's frames are kept (the next call starts there)."""
        return self.voice_of[slot].frames + self.own[slot]

    def _own_frame(self, slot: int, j: int) -> int:
        return self._stream_base + slot * self.stream_frames + j % self.stream_frames

    def _frame(self, slot: int, position: int) -> int:
        voice = self.voice_of[slot]
        if position < 0:
            return self.zero
        if position < voice.frames:
            return voice.offset + position
        return self._own_frame(slot, position - voice.frames)

    def row(self, slot: int, end: int, keep: bool) -> DiTRow:
        """The call row that renders the slot's frames from its last kept frame to `end`, keeping the
        complete chunks it reaches when `keep` (the stream goes on)."""
        voice, own = self.voice_of[slot], self.own[slot]
        start = voice.frames + own
        if end <= start:
            raise ValueError(f"nothing to render: frames kept up to {start}, asked up to {end}")
        kept = (end // self.chunk * self.chunk - start) if keep else 0
        first_own = max(0, own + kept - self.stream_frames)  # own frames this call's writes do not overwrite
        context = list(range(voice.offset, voice.offset + voice.frames))
        context += [self._own_frame(slot, j) for j in range(first_own, own)]
        # Read before this call writes anything (per step and convolution), so always the latest frames.
        left = [self._frame(slot, p) for p in range(start - LEFT, start)]
        # A call keeping more than the window (a long prompt the voice pool could not hold) keeps its latest
        # frames only: two frames of one call never share a ring place.
        writes = [self._own_frame(slot, own + j) if j >= kept - self.stream_frames else self.trash
                  for j in range(kept)]
        return DiTRow(start, end, context, writes, left)

    def advance(self, slot: int, row: DiTRow) -> None:
        """The row's call succeeded: its kept frames are the stream's now."""
        self.own[slot] += len(row.keep)

    @property
    def slid(self) -> list[bool]:
        return [own > self.stream_frames for own in self.own]

    # --- the batched solve ------------------------------------------------------------------------
    def padding_row(self) -> DiTRow:
        """A row that renders nothing real: no context, its frames written to the trash frame (the rows
        a CUDA-graph bucket holds beyond a call's)."""
        return DiTRow(0, 0, [], [], [self.zero] * LEFT)

    def table(self, rows: list[DiTRow], b: int, c: int, n: int) -> torch.Tensor:
        """The rows' index tables for a solve of `b` rows (rows beyond `rows` pad), `c` context and `n` new
        frames, packed into one host int64 tensor (pinned where a CUDA device will read it, so it goes
        over in one asynchronous copy): context frames (b, c) with their validity (b, c), write frames
        (b, n), the convolutions' left frames (b, LEFT), starts (b), lengths (b). `DiTTables` unpacks it."""
        if len(rows) > b or any(len(r.context) > c for r in rows) or any(r.end - r.start > n for r in rows):
            raise ValueError(f"rows exceed the solve's {b} rows, {c} context or {n} new frames")
        if max((r.end for r in rows), default=0) > self.sampler.rand_noise.size(2):
            raise ValueError(f"utterance exceeds the flow's {self.sampler.rand_noise.size(2)}-frame noise buffer")
        ctx = torch.full((b, c), self.zero, dtype=torch.long)
        ctx_ok = torch.zeros(b, c, dtype=torch.long)
        write = torch.full((b, n), self.trash, dtype=torch.long)
        left = torch.full((b, LEFT), self.zero, dtype=torch.long)
        starts = torch.zeros(b, dtype=torch.long)
        lengths = torch.zeros(b, dtype=torch.long)
        for i, r in enumerate(rows):
            ctx[i, :len(r.context)] = torch.tensor(r.context, dtype=torch.long)
            ctx_ok[i, :len(r.context)] = 1
            write[i, :len(r.keep)] = torch.tensor(r.keep, dtype=torch.long)
            left[i] = torch.tensor(r.left, dtype=torch.long)
            starts[i], lengths[i] = r.start, r.end - r.start
        packed = torch.cat([ctx.flatten(), ctx_ok.flatten(), write.flatten(), left.flatten(), starts, lengths])
        return packed.pin_memory() if self.device.type == "cuda" else packed

    @torch.inference_mode()
    def solve(self, rows: list[DiTRow], mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor) -> torch.Tensor:
        """Render each row's frames [start, end) through every Euler step: mu, cond (B, 80, N) (row b's
        frames at [0, end - start), right-padded), spks (B, 80). Returns the mel (B, 80, N) float32;
        keeps each row's `keep` frames' keys, values and convolution inputs in the pool."""
        b, n = len(rows), mu.size(2)
        c = max((len(r.context) for r in rows), default=0)
        # Checked on the host: nothing in the solve waits for the device.
        if max(r.end - r.start for r in rows) != n:
            raise ValueError(f"mu has {n} frames; the longest row needs {max(r.end - r.start for r in rows)}")
        tables = DiTTables(self.table(rows, b, c, n).to(self.device, non_blocking=True), b, c, n)
        return self.solve_tables(tables, mu, cond, spks)

    @torch.inference_mode()
    def solve_tables(self, t: DiTTables, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor,
                     regions: DiTRegions | None = None) -> torch.Tensor:
        """`solve` from index tables already on the device: device work only, no host sync and no host
        data, so a CUDA graph can record it (tts_core/accel/dit_graphs.py) with `t`, mu, cond and spks
        as its static inputs. `regions`: each block's work before, at and after its attention (default
        `pre_attention`, `pooled_sdpa`, `post_attention`; tts_core.accel.dit_graphs.graph_regions gives the
        CUDA kernel for the attention and, compiled, fuses the rest)."""
        regions = regions or EAGER_REGIONS
        est, dev = self.est, self.device
        n = t.new_frames
        ctx_idx, ctx_ok, write_idx, left_idx, starts, lengths = t.unpack()
        local = torch.arange(n, device=dev)
        valid = local[None] < lengths[:, None]  # (B, N)
        positions = torch.where(valid, starts[:, None] + local[None], 0)
        angles = (positions.to(est.rotary_embed.inv_freq.dtype)[..., None]
                  * est.rotary_embed.inv_freq).repeat_interleave(2, dim=-1).repeat(2, 1, 1)  # (2B, N, dh)
        # For q and k of every layer: x * cos + x[pair swapped] * (sin with the pair's sign), as apply_rotary.
        cos = angles.cos().to(self.dtype)[:, :, None]
        sin = (angles.sin() * self._constants.rotary_sign).to(self.dtype)[:, :, None]
        # Each row's real context frames are a prefix of its context columns: the fused kernel reads ctx_len.
        index = SolveIndex(ctx_idx, ctx_ok.sum(1), write_idx, lengths, self.chunk, cos, sin,
                           self._constants.rotary_swap,
                           self._mask(ctx_ok, valid, n) if regions.attention is pooled_sdpa else None)
        x = self.sampler.rand_noise[0][:, positions].permute(1, 0, 2).to(self.dtype)  # noise (B, 80, N)

        # Guidance rows: [0, B) conditioned, [B, 2B) with mu, cond and spks zeroed (as FlowSampler.solve).
        zeros = torch.zeros_like(mu)
        mu_in = torch.cat([mu, zeros]).to(self.dtype).transpose(1, 2)
        cond_in = torch.cat([cond, zeros]).to(self.dtype).transpose(1, 2)
        spks_in = torch.cat([spks, torch.zeros_like(spks)]).to(self.dtype)
        cfg_rate = self.sampler.cfg_rate
        for step, dt in enumerate(self._constants.dts):
            x_in = torch.cat([x, x]).transpose(1, 2)
            v = self._estimate(step, x_in, mu_in, cond_in, spks_in, index, left_idx, regions)
            v_cond, v_uncond = v.chunk(2)
            x = x + dt * ((1.0 + cfg_rate) * v_cond - cfg_rate * v_uncond)
        return x.float()

    def _mask(self, ctx_ok: torch.Tensor, valid: torch.Tensor, n: int) -> torch.Tensor:
        """The additive mask (2B, 1, N, C + N) of `pooled_sdpa`: context columns where valid; new keys valid,
        in the query's chunk or before (rows start on a chunk boundary), or the query itself (a padded query
        must see a key: an all-masked row would make NaN values). In the compute dtype, made once per solve:
        SDPA would convert a bool mask every layer."""
        dev = ctx_ok.device
        local = torch.arange(n, device=dev)
        rel_chunk = torch.div(local, self.chunk, rounding_mode="floor")
        see_new = (valid[:, None, :] & (rel_chunk[None, None, :] <= rel_chunk[None, :, None])) | torch.eye(
            n, dtype=torch.bool, device=dev)[None]
        visible = torch.cat([ctx_ok[:, None, :].expand(-1, n, -1), see_new], dim=2)[:, None]  # (B, 1, N, C+N)
        bias = torch.zeros(visible.shape, device=dev, dtype=self.dtype).masked_fill_(~visible, float("-inf"))
        return bias.repeat(2, 1, 1, 1)

    def _estimate(self, step: int, x: torch.Tensor, mu: torch.Tensor, cond: torch.Tensor, spks: torch.Tensor,
                  index: SolveIndex, left: torch.Tensor, regions: DiTRegions) -> torch.Tensor:
        """The DiT forward of the new frames (2B, N, C) at one Euler step -> velocity (2B, 80, N). The
        official block's arithmetic with fewer kernels (a solve replays ~220 blocks, and at a few rows
        its time is their count): q, k and v from one matmul (`_StepConstants`), rotary on q and k at
        once with its tables made once per solve, an additive mask made once per solve. The official
        op order otherwise: on the tiny golden model torch.addcmul's single rounding, or modulations
        precomputed from a one-row t, moved the streamed audio from 1.2e-4 to 2.1-3.3e-4 mean off the
        official, past the test's 2e-4 (its random HiFT amplifies mel rounding ~100x)."""
        est, consts = self.est, self._constants
        b, n = index.write.shape
        write = index.write.reshape(-1)
        emb = est.input_embed
        h = emb.proj(torch.cat([x, cond, mu, spks[:, None, :].expand(-1, n, -1)], dim=-1))  # (2B, N, dim)
        conv_in = h
        for k, conv in enumerate((emb.conv_pos_embed.conv1, emb.conv_pos_embed.conv2)):
            store = self.pos[step, :, k]  # (2, F, dim)
            past = store[:, left.reshape(-1)].reshape(2 * b, LEFT, -1)
            store.index_put_((torch.arange(2, device=self.device)[:, None], write[None]),
                             conv_in.reshape(2, b * n, -1))
            conv_in = conv(torch.cat([past, conv_in], dim=1).transpose(1, 2)).transpose(1, 2)
        h = conv_in + h
        # The time modulations as the official block computes them, per call (see the docstring).
        t_act = F.silu(est.time_embed(consts.times[step].expand(2 * b)))
        for layer, block in enumerate(est.transformer_blocks):
            qkv, mods = regions.pre(h, t_act, block.attn_norm.linear.weight, block.attn_norm.linear.bias,
                                    consts.qkv_weight[layer], consts.qkv_bias[layer])
            out = regions.attention(qkv, self.kv[layer, step], index, block.attn.heads)
            first, second = block.ff.ff[0][0], block.ff.ff[2]
            h = regions.post(h, out, mods, block.attn.to_out[0].weight, block.attn.to_out[0].bias,
                             first.weight, first.bias, second.weight, second.bias)
        scale, shift = est.norm_out.linear(t_act).chunk(2, dim=1)  # scale first: the checkpoint's order
        return est.proj_out(_norm(h) * (1 + scale[:, None, :]) + shift[:, None, :]).transpose(1, 2)


@dataclass(frozen=True)
class SolveIndex:
    """A solve's index tables as its blocks' attention reads them (made once per solve)."""

    ctx: torch.Tensor  # (B, C) pool frames of each row's context
    ctx_len: torch.Tensor  # (B,) how many of them are real (the first ones)
    write: torch.Tensor  # (B, N) pool frames the new frames' keys and values go to (trash: not kept)
    lengths: torch.Tensor  # (B,) each row's real new frames
    chunk: int  # frames of a chunk-causal attention chunk
    cos: torch.Tensor  # (2B, N, 1, dh) the rotary's tables at the new frames' positions (compute dtype)
    sin: torch.Tensor  # (2B, N, 1, dh) with each pair's sign (rotated = x cos + x[swap] sin)
    swap: torch.Tensor  # (dh,) the pair swap 1, 0, 3, 2, ...
    bias: torch.Tensor | None  # (2B, 1, N, C + N) additive mask, for `pooled_sdpa` only


def pooled_sdpa(qkv: torch.Tensor, kv: torch.Tensor, index: SolveIndex, heads: int) -> torch.Tensor:
    """A block's attention at one Euler step, generic: rotary on the first channels of q and k (x cos + x[pair
    swapped] x signed sin, as `apply_rotary`), the rows' context keys and values gathered from the pool (kv:
    this block's and step's, (2 guidance rows, 2 k|v, frames, inner)) before the new frames' are written into
    it, then SDPA with the additive mask. qkv (2B, N, 3, inner) -> (2B, N, inner). On CUDA
    tts_core/accel/dit_attention.py does the same in one kernel."""
    two_b, n, _, inner = qkv.shape
    b, c = index.ctx.shape
    rot = index.cos.size(-1)
    head = qkv[:, :, :2, :rot]
    qk = torch.cat([head * index.cos + head[..., index.swap] * index.sin, qkv[:, :, :2, rot:]], dim=-1)
    q, k, v = qk[:, :, 0], qk[:, :, 1], qkv[:, :, 2]
    flat_ctx, write = index.ctx.reshape(-1), index.write.reshape(-1)
    halves = torch.arange(2, device=qkv.device)[:, None]
    keys = torch.cat([kv[:, 0][:, flat_ctx].reshape(two_b, c, inner), k], dim=1)
    values = torch.cat([kv[:, 1][:, flat_ctx].reshape(two_b, c, inner), v], dim=1)
    kv[:, 0].index_put_((halves, write[None]), k.reshape(2, b * n, -1))
    kv[:, 1].index_put_((halves, write[None]), v.reshape(2, b * n, -1))
    q, keys, values = (y.unflatten(-1, (heads, -1)).transpose(1, 2) for y in (q, keys, values))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=index.bias).transpose(1, 2).flatten(2)


def pre_attention(h: torch.Tensor, t_act: torch.Tensor, mod_weight: torch.Tensor, mod_bias: torch.Tensor,
                  qkv_weight: torch.Tensor, qkv_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A DiT block up to its attention, on the pooled path: its six time modulations (official order),
    the modulated norm, q/k/v in one matmul (not yet rotated: the attention does it). -> q/k/v
    (2B, N, 3, inner), modulations (2B, 6 dim)."""
    mods = F.linear(t_act, mod_weight, mod_bias)
    shift_msa, scale_msa = (m[:, None, :] for m in mods.chunk(6, dim=1)[:2])
    qkv = F.linear(_norm(h) * (1 + scale_msa) + shift_msa, qkv_weight, qkv_bias)
    return qkv.view(h.size(0), h.size(1), 3, -1), mods


def post_attention(h: torch.Tensor, attn: torch.Tensor, mods: torch.Tensor, out_weight: torch.Tensor,
                   out_bias: torch.Tensor, ff1_weight: torch.Tensor, ff1_bias: torch.Tensor,
                   ff2_weight: torch.Tensor, ff2_bias: torch.Tensor) -> torch.Tensor:
    """A DiT block after its attention (heads flattened, (2B, N, inner)): output projection and gate,
    then the modulated tanh-GELU feed-forward and its gate."""
    _, _, gate_msa, shift_mlp, scale_mlp, gate_mlp = (m[:, None, :] for m in mods.chunk(6, dim=1))
    h = h + gate_msa * F.linear(attn, out_weight, out_bias)
    x = _norm(h) * (1 + scale_mlp) + shift_mlp
    return h + gate_mlp * F.linear(F.gelu(F.linear(x, ff1_weight, ff1_bias), approximate="tanh"), ff2_weight,
                                   ff2_bias)


@dataclass(frozen=True)
class DiTRegions:
    """What the pooled solve runs of each block: its work before and after the attention (the plain
    functions, or their torch.compile'd forms) and the attention with the pool's reads and writes
    (`pooled_sdpa`, or on CUDA tts_core.accel.dit_attention's kernel in its signature)."""

    pre: Callable[..., tuple[torch.Tensor, ...]] = pre_attention
    post: Callable[..., torch.Tensor] = post_attention
    attention: Callable[..., torch.Tensor] = pooled_sdpa


EAGER_REGIONS = DiTRegions()


@dataclass(frozen=True)
class _StepConstants:
    """What the pooled DiT uses the same in every solve, made once: each Euler step's t and dt (the
    official accumulation order, `euler_times`), each block's q/k/v weights stacked for one matmul (a
    copy: ~6 MB a block in bf16 at full size), and the rotary's pair swap and signs."""

    times: list[torch.Tensor]  # (1,) each
    dts: list[torch.Tensor]  # 0-d each
    qkv_weight: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]
    rotary_swap: torch.Tensor  # (dim_head,) long: 1, 0, 3, 2, ...
    rotary_sign: torch.Tensor  # (dim_head,) float: -1, +1, ... (rotated_half = x[swap] * sign)

    @classmethod
    @torch.inference_mode()
    def of(cls, sampler: FlowSampler, est: DiTEstimator, device: torch.device, dtype: torch.dtype) -> _StepConstants:
        times = euler_times(sampler.n_timesteps, sampler.scheduler, device, dtype)
        attns = [block.attn for block in est.transformer_blocks]
        dim_head = est.cfg.dim_head
        swap = torch.arange(dim_head, device=device).view(-1, 2).flip(-1).reshape(-1)
        sign = torch.tensor([-1.0, 1.0], device=device).repeat(dim_head // 2)
        return cls([t for t, _ in times], [dt for _, dt in times],
                   [torch.cat([a.to_q.weight, a.to_k.weight, a.to_v.weight]) for a in attns],
                   [torch.cat([a.to_q.bias, a.to_k.bias, a.to_v.bias]) for a in attns], swap, sign)
