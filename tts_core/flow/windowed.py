"""Later streaming chunks from a cached Euler trajectory: bounded memory, static shapes, batchable.

With chunk-causal masks and position-indexed noise, the frames of a finished chunk come out the
same in every later streaming call (see `incremental.py`). `IncrementalFlow` exploits that by
caching every layer's keys/values for every Euler step (~2.6 MB per frame in bf16). Here a request
keeps, per finished frame, only what the estimator *reads*: its Euler states x_1..x_9 and its
encoder output mu (10 x 80 values, 1.6 KB in bf16; x_0 is the noise buffer, the prompt mel is the
voice's). A later call re-runs the estimator over [context frames + new frames] at each of the 10
steps, feeding the context frames' cached x_{k-1} instead of integrating them again, and integrates
only the new frames. With the context = every earlier frame this is the official computation (the
context frames see exactly the inputs the full re-run gives them). With a bounded context (the
prompt's last chunks + the most recent chunks, `WindowPolicy`) cost and memory stop growing; the
frames outside the window are simply not attended to, which changes the output a little (measured
in tests/tts_core/test_flow_windowed.py and bench/bench_flow_batch.py).

Batching: every row of a call is laid out as [left padding | context | new frames | right padding]
with a frame-validity mask and an attention mask built from absolute frame positions. The
estimator multiplies by the frame mask before every convolution, so padding acts exactly like the
causal convolutions' zero padding, and padded keys are never attended to: each row computes what it
would compute alone, and one shape (rows, context capacity, new capacity) serves any mix of streams.

The encoder runs over the tokens of the new frames plus a token window before them (all tokens in
exact mode), batched across rows of equal token count (no padding: its convolutions and relative
positions would see the padding).

Not thread-safe: a state belongs to one request; a render call must own its states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tts_core.flow.model import FlowModel
from tts_core.flow.sampler import time_span


@dataclass(frozen=True)
class WindowPolicy:
    """How much of the past a later chunk sees. None everywhere: everything (exact).

    `prompt_chunks`/`recent_chunks` count estimator chunks (static_chunk_size frames, 50 in
    CosyVoice2 = 1 s); `encoder_tokens` counts speech tokens the encoder re-reads before the new ones.
    """

    prompt_chunks: int | None = None
    recent_chunks: int | None = None
    encoder_tokens: int | None = None

    @property
    def exact(self) -> bool:
        return self.recent_chunks is None and self.encoder_tokens is None


EXACT = WindowPolicy()


@dataclass(frozen=True)
class ChunkPlan:
    """One row of a render call, made by `WindowedFlowState.plan`."""

    enc_tokens: torch.Tensor  # (1, n) all-token ids the encoder reads (lookahead included if not final)
    finalize: bool
    ctx_frames: torch.Tensor  # (n_ctx,) long absolute frame index of each context frame
    ctx_traj: torch.Tensor  # (10, 80, n_ctx): x_0 (noise) .. x_9 of the context frames
    ctx_mu: torch.Tensor  # (80, n_ctx)
    start: int  # first new frame (absolute); new frames are [start, end)
    end: int
    commit: int  # frames [start, commit) are cached after the call (whole chunks only)

    @property
    def new_frames(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class WindowBatch:
    """Device tensors of one padded batch: rows x T = ctx_cap + new_cap frames (see the module doc)."""

    ctx_traj: torch.Tensor  # (B, 10, 80, ctx_cap)
    noise: torch.Tensor  # (B, 80, new_cap)
    mu: torch.Tensor  # (B, 80, T)
    cond: torch.Tensor  # (B, 80, T)
    spks: torch.Tensor  # (B, 80)
    pos: torch.Tensor  # (B, T) long absolute frame index, -1 for padding

    def copy_(self, other: WindowBatch) -> None:
        for name in ("ctx_traj", "noise", "mu", "cond", "spks", "pos"):
            getattr(self, name).copy_(getattr(other, name))


class WindowedFlowState:
    """One request's flow state for the windowed path: its voice prompt and its cached frames."""

    def __init__(self, model: FlowModel, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                 embedding: torch.Tensor, policy: WindowPolicy = EXACT) -> None:
        """prompt_token (1, P) int, prompt_feat (1, 2P, 80), embedding (1, 192) x-vector."""
        cfg = model.cfg
        param = model.input_embedding.weight
        self.policy = policy
        self.ratio, self.lookahead = cfg.token_mel_ratio, cfg.pre_lookahead_len
        self.token_chunk = cfg.encoder.static_chunk_size
        self.chunk = cfg.estimator.static_chunk_size
        if self.token_chunk <= 0 or self.chunk != self.token_chunk * self.ratio:
            raise ValueError("windowed flow: encoder and estimator chunks must cover the same frames")
        self.prompt_token = prompt_token.to(param.device, torch.long)
        self.prompt_feat = prompt_feat.to(param.device, param.dtype)  # (1, 2P, 80)
        with torch.inference_mode():
            self.spks = model.speaker(embedding.to(param.device, param.dtype))  # (1, 80)
        self.noise = model.decoder.rand_noise[0]  # (80, 15000) float32
        self.dtype = param.dtype
        self.committed = 0  # frames [0, committed) are final and (within the policy) cached
        self.emitted = prompt_feat.size(1)  # the prompt is never returned
        self.finished = False
        # Cached frames: chunk indices and, per frame, x_1..x_9 then mu (10, 80, frames).
        self.kept_chunks: list[int] = []
        self.cache = torch.zeros(10, cfg.output_size, 0, device=param.device, dtype=param.dtype)

    @property
    def prompt_frames(self) -> int:
        return self.prompt_feat.size(1)

    def cache_bytes(self) -> int:
        return self.cache.numel() * self.cache.element_size()

    def _context_chunks(self) -> list[int]:
        """The finished chunks the next call attends to (all of them in exact mode)."""
        done = self.committed // self.chunk
        if self.policy.recent_chunks is None:
            return list(range(done))
        prompt_last = -(-self.prompt_frames // self.chunk)  # one past the chunk holding the prompt's end
        keep = set(range(max(0, prompt_last - (self.policy.prompt_chunks or 0)), min(prompt_last, done)))
        keep.update(range(max(0, done - self.policy.recent_chunks), done))
        return sorted(keep)

    def plan(self, tokens: torch.Tensor, finalize: bool) -> ChunkPlan:
        """tokens (1, N): every speech token of the request so far, as the official streaming call
        gets them; a non-final call's last `pre_lookahead_len` tokens are lookahead only."""
        if self.finished:
            raise RuntimeError("windowed flow: render after the final call")
        all_tokens = torch.cat([self.prompt_token, tokens.to(self.prompt_token.device, torch.long)], dim=1)
        end_tok = all_tokens.size(1) if finalize else all_tokens.size(1) - self.lookahead
        end = end_tok * self.ratio
        if end <= self.committed or end < self.emitted:
            raise ValueError(f"windowed flow: {tokens.size(1)} tokens is fewer than already rendered")
        commit = end if finalize else end_tok // self.token_chunk * self.token_chunk * self.ratio
        start_tok = self.committed // self.ratio
        enc_start = 0
        if self.policy.encoder_tokens is not None:
            enc_start = max(0, -(-(start_tok - self.policy.encoder_tokens) // self.token_chunk) * self.token_chunk)
        chunks = self._context_chunks()
        index = {c: i for i, c in enumerate(self.kept_chunks)}
        kept = self.cache.index_select(2, self._frames([index[c] for c in chunks]))
        frames = self._frames(chunks)
        noise0 = self.noise.index_select(1, frames.to(self.noise.device)).to(self.cache.device, self.dtype)
        return ChunkPlan(all_tokens[:, enc_start:], finalize, frames, torch.cat([noise0[None], kept[:9]]), kept[9],
                         self.committed, end, commit)

    def commit(self, plan: ChunkPlan, traj: torch.Tensor, mu: torch.Tensor, mel: torch.Tensor) -> torch.Tensor:
        """After the call: traj (9, 80, n_new) x_1..x_9 of the new frames, mu (80, n_new), mel
        (1, 80, n_new). Caches the finished chunks and returns the frames not returned before."""
        n_keep = plan.commit - plan.start
        new = torch.cat([traj[:, :, :n_keep], mu[None, :, :n_keep]]).to(self.dtype)
        self.kept_chunks = self.kept_chunks + list(range(plan.start // self.chunk, -(-plan.commit // self.chunk)))
        self.cache = torch.cat([self.cache, new], dim=2)  # a new tensor: earlier plans stay valid
        self.committed = plan.commit
        out = mel[:, :, self.emitted - plan.start:]
        self.emitted = plan.end
        self.finished = plan.finalize
        if not self.finished:
            self._forget()
        return out

    def _forget(self) -> None:
        """Drop cached chunks that no later call will attend to (bounded policies only)."""
        wanted = self._context_chunks()
        if wanted == self.kept_chunks:
            return
        index = {c: i for i, c in enumerate(self.kept_chunks)}
        self.cache = self.cache.index_select(2, self._frames([index[c] for c in wanted]))
        self.kept_chunks = wanted

    def _frames(self, chunks: list[int]) -> torch.Tensor:
        """Frame indices (long, on the cache's device) of whole chunks, in order."""
        c = torch.tensor(chunks, dtype=torch.long).unsqueeze(1) * self.chunk
        return (c + torch.arange(self.chunk)).flatten().to(self.cache.device)


def encode_new_frames(model: FlowModel, enc_tokens: torch.Tensor, finalize: bool, new_frames: int) -> torch.Tensor:
    """enc_tokens (B, n) of equal length -> mu (B, 80, new_frames) of the last `new_frames` frames.
    No host syncs (capturable, given device-side position tables)."""
    emb = model.embed_tokens(enc_tokens)
    if finalize:
        h = model.encoder(emb, True)
    else:
        k = model.cfg.pre_lookahead_len
        h = model.encoder(emb[:, :-k], True, context_emb=emb[:, -k:])
    return model.encoder_proj(h[:, h.size(1) - new_frames:]).transpose(1, 2).contiguous()


def stack_rows(states: Sequence[WindowedFlowState], plans: Sequence[ChunkPlan], mus: Sequence[torch.Tensor],
               rows: int, ctx_cap: int, new_cap: int) -> WindowBatch:
    """Lay the plans out as one padded batch of `rows` rows (rows past len(plans) are all padding)."""
    s0 = states[0]
    device, dtype, mel = s0.cache.device, s0.dtype, s0.cache.size(1)
    frames = ctx_cap + new_cap
    ctx_traj = torch.zeros(rows, 10, mel, ctx_cap, device=device, dtype=dtype)
    noise = torch.zeros(rows, mel, new_cap, device=device, dtype=dtype)
    mu = torch.zeros(rows, mel, frames, device=device, dtype=dtype)
    cond = torch.zeros_like(mu)
    spks = torch.zeros(rows, mel, device=device, dtype=dtype)
    pos = torch.full((rows, frames), -1, dtype=torch.long, device=device)
    for i, (state, plan, mu_new) in enumerate(zip(states, plans, mus)):
        n_ctx, n_new = plan.ctx_frames.numel(), plan.new_frames
        a = ctx_cap - n_ctx
        ctx_traj[i, :, :, a:] = plan.ctx_traj
        noise[i, :, :n_new] = state.noise[:, plan.start:plan.end].to(device, dtype)
        mu[i, :, a:ctx_cap] = plan.ctx_mu
        mu[i, :, ctx_cap:ctx_cap + n_new] = mu_new
        pos[i, a:ctx_cap] = plan.ctx_frames
        pos[i, ctx_cap:ctx_cap + n_new] = torch.arange(plan.start, plan.end, device=device)
        prompt_pos = pos[i].clamp(min=0)
        in_prompt = (pos[i] >= 0) & (prompt_pos < state.prompt_frames)
        feat = state.prompt_feat[0].T.index_select(1, prompt_pos.clamp(max=state.prompt_frames - 1))
        cond[i] = feat * in_prompt.to(dtype)
        spks[i] = state.spks[0]
    return WindowBatch(ctx_traj, noise, mu, cond, spks, pos)


def window_attention_mask(pos: torch.Tensor, chunk: int, left_chunks: int) -> torch.Tensor:
    """pos (B, T) -> (B, 1, T, T) bool: the chunk-causal rule on absolute frame positions, padded
    keys hidden; a padded query sees only itself (an all-False row would make softmax NaN)."""
    valid = pos >= 0
    c = torch.div(pos, chunk, rounding_mode="floor")
    ok = (c.unsqueeze(1) <= c.unsqueeze(2)) & valid.unsqueeze(1) & valid.unsqueeze(2)
    if left_chunks >= 0:
        ok &= c.unsqueeze(1) >= (c.unsqueeze(2) - left_chunks)
    eye = torch.eye(pos.size(1), dtype=torch.bool, device=pos.device)
    return (ok | eye).unsqueeze(1)


def windowed_solve(model: FlowModel, batch: WindowBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The 10 guided Euler steps over a padded batch. Returns (mel (B, 80, new_cap) float32,
    traj (B, 9, 80, new_cap) x_1..x_9 of the new frames). No host syncs: capturable."""
    sampler = model.decoder
    est = sampler.estimator
    rows, ctx_cap = batch.ctx_traj.size(0), batch.ctx_traj.size(3)
    dtype = batch.mu.dtype
    frame_mask = (batch.pos >= 0).to(dtype).unsqueeze(1)  # (B, 1, T)
    attn = window_attention_mask(batch.pos, est.cfg.static_chunk_size, est.cfg.num_decoding_left_chunks)
    attn_in = torch.cat([attn, attn])
    mask_in = torch.cat([frame_mask, frame_mask])
    zeros = torch.zeros_like(batch.mu)
    mu_in = torch.cat([batch.mu, zeros])
    cond_in = torch.cat([batch.cond, zeros])
    spks_in = torch.cat([batch.spks, torch.zeros_like(batch.spks)])
    span = time_span(sampler.n_timesteps, sampler.scheduler, batch.mu.device, dtype)
    x = batch.noise
    traj = []
    # The official solver's accumulation order (t += dt; dt = t_{k+1} - t), as FlowSampler.solve.
    t = span[0].unsqueeze(0)
    dt = span[1] - span[0]
    for step in range(1, len(span)):
        full = torch.cat([batch.ctx_traj[:, step - 1], x], dim=2)
        v = est(torch.cat([full, full]), mask_in, mu_in, t.expand(2 * rows), spks_in, cond_in, attn_in)
        v = v[:, :, ctx_cap:]
        x = x + dt * ((1.0 + sampler.cfg_rate) * v[:rows] - sampler.cfg_rate * v[rows:])
        t = t + dt
        if step < len(span) - 1:
            dt = span[step + 1] - t
            traj.append(x)
    return x.float(), torch.stack(traj, dim=1)


@torch.inference_mode()
def render_windowed(model: FlowModel, states: Sequence[WindowedFlowState], tokens: Sequence[torch.Tensor],
                    finalize: Sequence[bool]) -> list[torch.Tensor]:
    """Eager reference of `BatchedFlowRenderer.render`: one padded batch, mel (1, 80, new) per state."""
    plans = [s.plan(t, f) for s, t, f in zip(states, tokens, finalize)]
    mus = encode_grouped(model, plans)
    ctx_cap = max(p.ctx_frames.numel() for p in plans)
    new_cap = max(p.new_frames for p in plans)
    batch = stack_rows(states, plans, mus, len(plans), ctx_cap, new_cap)
    mel, traj = windowed_solve(model, batch)
    return [s.commit(p, traj[i, :, :, :p.new_frames], mus[i], mel[i:i + 1, :, :p.new_frames])
            for i, (s, p) in enumerate(zip(states, plans))]


def encode_grouped(model: FlowModel, plans: Sequence[ChunkPlan], encode=None) -> list[torch.Tensor]:
    """mu (80, new frames) per plan; plans of equal (tokens, new frames, finalize) share one call
    of `encode(model, tokens (B, n), finalize, new_frames)` (default `encode_new_frames`)."""
    encode = encode or encode_new_frames
    groups: dict[tuple[int, int, bool], list[int]] = {}
    for i, p in enumerate(plans):
        groups.setdefault((p.enc_tokens.size(1), p.new_frames, p.finalize), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(plans)
    for (_, new_frames, fin), members in groups.items():
        mu = encode(model, torch.cat([plans[i].enc_tokens for i in members]), fin, new_frames)
        for row, i in enumerate(members):
            out[i] = mu[row]
    return out  # type: ignore[return-value]
