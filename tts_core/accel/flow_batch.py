"""Render the due later chunks of many streams in one call: CUDA graphs per shape bucket.

`tts_core.flow.windowed` makes a chunk's flow work a function of static shapes: rows (2 per stream
for the guidance pair), context capacity and new-frame capacity for the 10-step solve, and
(rows, token count) for the encoder. This module captures those two calls per bucket and replays
them; anything without a captured bucket (CPU, an odd shape) runs the same code eagerly.

Use (scheduler thread only):

    renderer = BatchedFlowRenderer(flow)
    renderer.capture(ctx_cap=150, new_cap=100, enc_tokens=103, batches=(1, 4, 16, 32))   # start-up
    state = WindowedFlowState(flow, prompt_token, prompt_feat, embedding, policy)       # per request
    mels = renderer.render([state, ...], [tokens_so_far, ...], [finalize, ...])          # per tick

Each returned mel is (1, 80, new frames) float32, owned by the caller.
"""

from __future__ import annotations

from collections.abc import Sequence

import structlog
import torch

from tts_core.accel.graph_capture import capture_graph
from tts_core.flow.model import FlowModel
from tts_core.flow.windowed import (ChunkPlan, WindowBatch, WindowedFlowState, encode_grouped, encode_new_frames,
                                    stack_rows, windowed_solve)

log = structlog.get_logger(__name__)


class _SolveGraph:
    def __init__(self, model: FlowModel, rows: int, ctx_cap: int, new_cap: int, pool) -> None:
        param = model.input_embedding.weight
        mel, frames = model.cfg.output_size, ctx_cap + new_cap
        z = dict(device=param.device, dtype=param.dtype)
        pos = torch.arange(frames, device=param.device).expand(rows, -1).clone()  # a plausible warm-up layout
        self.batch = WindowBatch(torch.zeros(rows, 10, mel, ctx_cap, **z), torch.zeros(rows, mel, new_cap, **z),
                                 torch.zeros(rows, mel, frames, **z), torch.zeros(rows, mel, frames, **z),
                                 torch.zeros(rows, mel, **z), pos)
        self.graph = torch.cuda.CUDAGraph()
        self.out = capture_graph(self.graph, lambda: windowed_solve(model, self.batch), warmup=2, pool=pool)

    def replay(self, batch: WindowBatch) -> tuple[torch.Tensor, torch.Tensor]:
        self.batch.copy_(batch)
        self.graph.replay()
        return self.out


class _EncodeGraph:
    def __init__(self, model: FlowModel, rows: int, tokens: int, new_frames: int, finalize: bool, pool) -> None:
        from tts_core.accel.flow_graphs import device_position_tables

        self.tokens = torch.zeros(rows, tokens, dtype=torch.long, device=model.input_embedding.weight.device)
        self.graph = torch.cuda.CUDAGraph()
        self._tables: dict = {}  # position tables the graph reads: must live as long as it
        with device_position_tables(self._tables):
            self.out = capture_graph(self.graph, lambda: encode_new_frames(model, self.tokens, finalize, new_frames),
                                     warmup=2, pool=pool)

    def replay(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens[:tokens.size(0)].copy_(tokens)
        self.graph.replay()
        return self.out[:tokens.size(0)]


class BatchedFlowRenderer:
    """One render call per scheduler tick for all streams with a due chunk (first, later or final)."""

    def __init__(self, model: FlowModel) -> None:
        self.model = model
        self.device = model.input_embedding.weight.device
        self.solve_graphs: dict[tuple[int, int, int], _SolveGraph] = {}  # (rows, ctx_cap, new_cap)
        self.encode_graphs: dict[tuple[int, int, int, bool], _EncodeGraph] = {}  # (rows, tokens, new, final)
        self._pool = None

    def capture(self, ctx_cap: int, new_cap: int, enc_tokens: int | None = None, finalize: bool = False,
                batches: Sequence[int] = (1, 4, 16, 32)) -> None:
        """Capture the solve for (each batch, ctx_cap, new_cap) and, with `enc_tokens`, the encoder
        for calls of that many tokens rendering `new_cap` frames (start-up only; CUDA only)."""
        if self.device.type != "cuda":
            raise RuntimeError("BatchedFlowRenderer.capture needs the model on a CUDA device")
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        for rows in sorted(batches, reverse=True):  # largest first: later captures reuse its pool blocks
            if (rows, ctx_cap, new_cap) not in self.solve_graphs:
                self.solve_graphs[(rows, ctx_cap, new_cap)] = _SolveGraph(self.model, rows, ctx_cap, new_cap,
                                                                          self._pool)
            key = (rows, enc_tokens, new_cap, finalize)
            if enc_tokens is not None and key not in self.encode_graphs:
                self.encode_graphs[key] = _EncodeGraph(self.model, rows, enc_tokens, new_cap, finalize, self._pool)
        log.info("flow_batch_captured", ctx_cap=ctx_cap, new_cap=new_cap, enc_tokens=enc_tokens, finalize=finalize,
                 batches=list(batches), solve_graphs=len(self.solve_graphs), encode_graphs=len(self.encode_graphs))

    @torch.inference_mode()
    def render(self, states: Sequence[WindowedFlowState], tokens: Sequence[torch.Tensor],
               finalize: Sequence[bool]) -> list[torch.Tensor]:
        """states[i] gets tokens[i] (1, N_i): every speech token of its request so far; returns the
        new mel frames (1, 80, n_i) per state, in order. Streams of any lengths may be mixed."""
        plans = [s.plan(t, f) for s, t, f in zip(states, tokens, finalize)]
        mus = encode_grouped(self.model, plans, self._encode)
        out: list[torch.Tensor] = []
        largest = max((r for r, _, _ in self.solve_graphs), default=len(plans))
        for a in range(0, len(plans), largest):
            out += self._solve(states[a:a + largest], plans[a:a + largest], mus[a:a + largest])
        return out

    def _encode(self, model: FlowModel, enc_tokens: torch.Tensor, fin: bool, new_frames: int) -> torch.Tensor:
        rows, n = enc_tokens.shape
        fits = [k for k in self.encode_graphs if k[1:] == (n, new_frames, fin) and k[0] >= rows]
        if not fits:
            return encode_new_frames(model, enc_tokens, fin, new_frames)
        return self.encode_graphs[min(fits)].replay(enc_tokens).clone()

    def _solve(self, states: Sequence[WindowedFlowState], plans: Sequence[ChunkPlan],
               mus: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        rows = len(plans)
        n_ctx = max(p.ctx_frames.numel() for p in plans)
        n_new = max(p.new_frames for p in plans)
        fits = [k for k in self.solve_graphs if k[0] >= rows and k[1] >= n_ctx and k[2] >= n_new]
        if fits:
            key = min(fits, key=lambda k: (k[1] + k[2], k[0]))
            mel, traj = self.solve_graphs[key].replay(stack_rows(states, plans, mus, key[0], key[1], key[2]))
        else:
            mel, traj = windowed_solve(self.model, stack_rows(states, plans, mus, rows, n_ctx, n_new))
        # Graph outputs are overwritten by the next replay: commit copies the trajectory; mel is cloned.
        return [s.commit(p, traj[i, :, :, :p.new_frames], mus[i], mel[i:i + 1, :, :p.new_frames].clone())
                for i, (s, p) in enumerate(zip(states, plans))]
