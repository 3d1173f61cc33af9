"""Flow calls of bounded cost, batched across streams: prompt + a sliding window of spoken tokens.

The official streaming caller re-runs the flow over the prompt and every token so far on every
chunk, so a chunk's cost grows with what was already said; `IncrementalFlow` removes the re-run but
keeps growing caches (~2.7 MB per frame in bf16) that no static graph can hold. Here a chunk's
call sees the voice prompt, at most `window_tokens` already-rendered tokens before the chunk, and
the chunk itself (lookahead included): the shape depends only on the schedule, never on the
utterance's length, so one CUDA graph per (batch bucket, call tokens, finalize) serves every
stream, and the due chunks of many streams run as one batched call (2 rows per stream for the
classifier-free guidance pair).

Every frame keeps the noise the official full call gives it (its absolute position in the
official noise buffer), so with `window_tokens` >= everything spoken the frames equal the official
ones; with a shorter window only the context beyond the window is missing (measured in
tests/tts_core/test_runtime_window_flow.py and bench/bench_load.py).

A final chunk is rendered from the last `window_tokens + max_hop + lookahead` tokens (more context,
same shape); only an utterance shorter than that has a call shape of its own (eager unless captured).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tts_core.flow import FlowModel
from tts_core.flow.sampler import time_span
from tts_core.streaming.chunk_schedule import ChunkPlanner, ChunkSchedule, ChunkTask


@dataclass(frozen=True)
class FlowWindow:
    """Which tokens one chunk's flow call reads, and which of its frames the chunk keeps."""

    start: int  # first speech token of the call
    end: int  # one past the last (lookahead included when not final)
    keep_from: int  # first mel frame (after the prompt) of the call that belongs to the chunk
    finalize: bool

    @property
    def tokens(self) -> int:
        return self.end - self.start


def flow_window(task: ChunkTask, schedule: ChunkSchedule, window_tokens: int, ratio: int) -> FlowWindow:
    if task.finalize:
        span = window_tokens + schedule.max_hop_tokens + schedule.lookahead_tokens
        start = max(0, min(task.token_offset, task.token_end - span))
    else:
        start = max(0, task.token_offset - window_tokens)
    return FlowWindow(start, task.token_end, (task.token_offset - start) * ratio, task.finalize)


def steady_shapes(schedule: ChunkSchedule, prompt_tokens: int, window_tokens: int, ratio: int,
                  tokens: int = 2000) -> list[tuple[int, bool]]:
    """The (call tokens, finalize) shapes a long utterance passes through; the final shape is the
    one every utterance longer than the final span uses."""
    planner = ChunkPlanner(schedule, prompt_tokens)
    shapes: list[tuple[int, bool]] = []
    while (task := planner.next_chunk(tokens, False)) is not None:
        shape = (flow_window(task, schedule, window_tokens, ratio).tokens, False)
        if shape in shapes:
            break
        shapes.append(shape)
    shapes.append((window_tokens + schedule.max_hop_tokens + schedule.lookahead_tokens, True))
    return shapes


@dataclass(frozen=True)
class VoiceFlowPrompt:
    """A voice's flow inputs on the device, computed once per voice and shared by its streams."""

    token: torch.Tensor  # (1, P) long
    feat: torch.Tensor  # (1, 2P, 80)
    spks: torch.Tensor  # (1, 80) the speaker projection

    @classmethod
    def build(cls, flow: FlowModel, voice) -> VoiceFlowPrompt:
        param = flow.input_embedding.weight
        token = torch.tensor([voice.flow_prompt_speech_token], dtype=torch.long, device=param.device)
        feat = voice.prompt_speech_feat[None].to(param.device, param.dtype)
        with torch.inference_mode():
            spks = flow.speaker(voice.flow_embedding[None].to(param.device, param.dtype))
        return cls(token, feat, spks)


def window_noise(flow: FlowModel, prompt_frames: int, window: FlowWindow, dtype: torch.dtype) -> torch.Tensor:
    """(1, 80, frames) the official noise of the prompt frames and of the window's frames."""
    ratio = flow.cfg.token_mel_ratio
    frames = window.tokens * ratio if window.finalize else (window.tokens - flow.cfg.pre_lookahead_len) * ratio
    buf = flow.decoder.rand_noise
    a = prompt_frames + window.start * ratio
    return torch.cat([buf[:, :, :prompt_frames], buf[:, :, a:a + frames]], dim=2).to(dtype)


def batched_flow_call(flow: FlowModel, prompt_token: torch.Tensor, token: torch.Tensor, prompt_feat: torch.Tensor,
                      spks: torch.Tensor, noise: torch.Tensor, finalize: bool) -> torch.Tensor:
    """B streams of equal shapes: prompt_token (B, P), token (B, N), prompt_feat (B, 2P, 80), spks
    (B, 80), noise (B, 80, T). Returns mel (B, 80, T - 2P) float32 after the prompt. The same
    arithmetic as `FlowModel.inference(streaming=True)` row by row (no device-to-host syncs, so
    capturable)."""
    rows = token.size(0)
    emb = flow.embed_tokens(torch.cat([prompt_token, token], dim=1))
    if finalize:
        h = flow.encoder(emb, True)
    else:
        k = flow.cfg.pre_lookahead_len
        h = flow.encoder(emb[:, :-k], True, context_emb=emb[:, -k:])
    mu = flow.encoder_proj(h).transpose(1, 2).contiguous()
    frames, prompt_frames = mu.size(2), prompt_feat.size(1)
    cond = torch.zeros_like(mu)
    cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2).to(mu.dtype)
    sampler = flow.decoder
    attn_mask = sampler.estimator.attention_mask(frames, True, mu.device)
    span = time_span(sampler.n_timesteps, sampler.scheduler, mu.device, mu.dtype)
    dtype = spks.dtype
    zeros = torch.zeros_like(mu)
    mu_in = torch.cat([mu, zeros]).to(dtype)
    cond_in = torch.cat([cond, zeros]).to(dtype)
    spks_in = torch.cat([spks, torch.zeros_like(spks)]).to(dtype)
    mask_in = torch.ones(2 * rows, 1, frames, device=mu.device, dtype=dtype)
    x = noise.to(mu.dtype)
    # The official solver's accumulation order (t += dt; dt = t_{k+1} - t), as FlowSampler.solve.
    t = span[0].unsqueeze(0)
    dt = span[1] - span[0]
    for step in range(1, len(span)):
        x_in = torch.cat([x, x]).to(dtype)
        t_in = t.to(dtype).expand(2 * rows)
        v = sampler.estimator(x_in, mask_in, mu_in, t_in, spks_in, cond_in, attn_mask)
        x = x + dt * ((1.0 + sampler.cfg_rate) * v[:rows] - sampler.cfg_rate * v[rows:])
        t = t + dt
        if step < len(span) - 1:
            dt = span[step + 1] - t
    return x.float()[:, :, prompt_frames:]


@dataclass
class FlowRequest:
    """One stream's due chunk: its voice prompt, all its tokens so far and the window to render."""

    prompt: VoiceFlowPrompt
    tokens: Sequence[int]
    window: FlowWindow


class WindowFlowRunner:
    """Renders due chunks in batches: eager, or by CUDA-graph replay for the captured shapes."""

    def __init__(self, flow: FlowModel) -> None:
        self.flow = flow
        self.device = flow.input_embedding.weight.device
        self.dtype = flow.input_embedding.weight.dtype
        self.graphs: dict[tuple[int, int, int, bool], _FlowGraph] = {}  # (batch, prompt, tokens, final)

    def batch_buckets(self, prompt_tokens: int, tokens: int, finalize: bool) -> list[int]:
        return sorted(b for (b, p, n, f) in self.graphs if (p, n, f) == (prompt_tokens, tokens, finalize))

    @torch.inference_mode()
    def render(self, requests: Sequence[FlowRequest]) -> list[torch.Tensor]:
        """Mel (1, 80, chunk frames) per request (same order); requests may have any shapes."""
        groups: dict[tuple[int, int, bool], list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault((r.prompt.token.size(1), r.window.tokens, r.window.finalize), []).append(i)
        out: list[torch.Tensor | None] = [None] * len(requests)
        for (prompt_tokens, tokens, finalize), members in groups.items():
            buckets = self.batch_buckets(prompt_tokens, tokens, finalize)
            while members:
                fitting = [b for b in buckets if b >= len(members)]
                take = min(len(members), buckets[-1]) if buckets else len(members)
                part, members = members[:take], members[take:]
                bucket = (min(fitting) if fitting else buckets[-1]) if buckets else None
                mels = self._call([requests[i] for i in part], bucket)
                for row, i in enumerate(part):
                    out[i] = mels[row:row + 1, :, requests[i].window.keep_from:]
        return out  # type: ignore[return-value]

    def _inputs(self, requests: Sequence[FlowRequest]) -> tuple[torch.Tensor, ...]:
        prompt_frames = requests[0].prompt.feat.size(1)
        token = torch.tensor([list(r.tokens[r.window.start:r.window.end]) for r in requests], dtype=torch.long)
        return (torch.cat([r.prompt.token for r in requests]), token.to(self.device, non_blocking=True),
                torch.cat([r.prompt.feat for r in requests]), torch.cat([r.prompt.spks for r in requests]),
                torch.cat([window_noise(self.flow, prompt_frames, r.window, self.dtype) for r in requests]))

    def _call(self, requests: Sequence[FlowRequest], bucket: int | None) -> torch.Tensor:
        inputs = self._inputs(requests)
        finalize = requests[0].window.finalize
        if bucket is None:
            return batched_flow_call(self.flow, *inputs, finalize)
        graph = self.graphs[(bucket, requests[0].prompt.token.size(1), requests[0].window.tokens, finalize)]
        return graph.replay(inputs, len(requests))

    def capture(self, prompt: VoiceFlowPrompt, shapes: Sequence[tuple[int, bool]], batches: Sequence[int]) -> None:
        """Capture a graph per (batch, shape) for streams of this prompt length (start-up only)."""
        for tokens, finalize in shapes:
            for batch in sorted(batches, reverse=True):
                key = (batch, prompt.token.size(1), tokens, finalize)
                if key not in self.graphs:
                    self.graphs[key] = _FlowGraph(self.flow, prompt, tokens, finalize, batch)


class _FlowGraph:
    """One captured `batched_flow_call`; inputs are copied into its static buffers."""

    _pool = None

    def __init__(self, flow: FlowModel, prompt: VoiceFlowPrompt, tokens: int, finalize: bool, batch: int) -> None:
        from tts_core.accel.flow_graphs import device_position_tables

        frames = (tokens if finalize else tokens - flow.cfg.pre_lookahead_len) * flow.cfg.token_mel_ratio
        frames += prompt.feat.size(1)
        self.static = (prompt.token.expand(batch, -1).clone(),
                       torch.zeros(batch, tokens, dtype=torch.long, device=prompt.token.device),
                       prompt.feat.expand(batch, -1, -1).clone(), prompt.spks.expand(batch, -1).clone(),
                       flow.decoder.rand_noise[:, :, :frames].to(prompt.feat.dtype).expand(batch, -1, -1).clone())
        self.graph = torch.cuda.CUDAGraph()
        if _FlowGraph._pool is None:
            _FlowGraph._pool = torch.cuda.graph_pool_handle()
        self._tables: dict = {}  # position tables the graph reads; must live as long as it
        with device_position_tables(self._tables), torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    batched_flow_call(flow, *self.static, finalize)
            torch.cuda.current_stream().wait_stream(side)
            with torch.cuda.graph(self.graph, pool=_FlowGraph._pool):
                self.out = batched_flow_call(flow, *self.static, finalize)

    def replay(self, inputs: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        for buf, x in zip(self.static, inputs):
            buf[:rows].copy_(x)
        self.graph.replay()
        return self.out[:rows]
