"""CUDA-graph replay of one whole flow call (encoder + 10 guided Euler steps) for fixed shapes; a
baseline of bench/bench_components.py only (the product renders through tts_core.flow.pooled).

A flow call is ~20 estimator evaluations of ~900 small kernels each; eagerly the launches, not the
arithmetic, set its time. With the official streaming schedule the shapes of a request's k-th call
depend only on the prompt length and the hop sizes, so one graph per (prompt tokens, call tokens,
finalize) serves every request of that shape: the first chunk of every request of a 150-token
voice is the same graph.

`GraphedFlowCall` renders like `FlowModel.inference(..., streaming=True)` (full recompute of the
prompt and every token so far) and returns the frames after the prompt. It suits the first chunk,
whose latency matters most; later chunks are cheaper with `IncrementalFlow`, whose growing caches
do not fit a static graph.
"""

from __future__ import annotations

import torch

from tts_core.accel.flow_pool_graphs import device_position_tables
from tts_core.accel.graph_capture import capture_graph
from tts_core.flow.model import FlowModel


class GraphedFlowCall:
    def __init__(self, model: FlowModel, prompt_tokens: int, prompt_frames: int, call_tokens: int,
                 finalize: bool = False, warmup: int = 2) -> None:
        """Shapes: prompt_token (1, prompt_tokens), prompt_feat (1, prompt_frames, 80), token
        (1, call_tokens) speech tokens of this call (the lookahead included when not final)."""
        param = next(model.parameters())
        if not param.is_cuda:
            raise RuntimeError("GraphedFlowCall needs the model on a CUDA device")
        self.model = model
        self.finalize = finalize
        device = param.device
        self.prompt_token = torch.zeros(1, prompt_tokens, dtype=torch.long, device=device)
        self.token = torch.zeros(1, call_tokens, dtype=torch.long, device=device)
        self.prompt_feat = torch.zeros(1, prompt_frames, model.cfg.output_size, dtype=param.dtype, device=device)
        self.embedding = torch.zeros(1, model.cfg.spk_embed_dim, dtype=param.dtype, device=device)
        self._graph = torch.cuda.CUDAGraph()
        self._tables: dict = {}
        with device_position_tables(self._tables):
            self._out = capture_graph(self._graph, self._call, warmup)

    def _call(self) -> torch.Tensor:
        c = self.model.condition(self.token, self.prompt_token, self.prompt_feat, self.embedding,
                                 streaming=True, finalize=self.finalize)
        mel = self.model.decoder(c.mu, c.mask, c.spks, c.cond, streaming=True)
        return mel[:, :, c.prompt_frames:]

    @torch.inference_mode()
    def render(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
               embedding: torch.Tensor) -> torch.Tensor:
        """Mel (1, 80, new_frames) float32 — a view valid until the next `render` of this graph."""
        self.token.copy_(token)
        self.prompt_token.copy_(prompt_token)
        self.prompt_feat.copy_(prompt_feat)
        self.embedding.copy_(embedding)
        self._graph.replay()
        return self._out
