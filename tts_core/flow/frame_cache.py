"""Left-context state of the flow's causal layers, for rendering a sequence one span at a time.

A chunk-wise pass computes frames [start, end) of a sequence whose frames [0, start) were computed
before. Causal convolutions need their last few input frames before `start`; chunk-causal
attention needs the keys and values of every earlier frame. After the pass the state is kept up to
`commit` (a chunk boundary <= end): frames of an unfinished chunk will see more keys once the chunk
fills up, so they are recomputed by the next pass, never cached.

Layers talk to it through two calls that any left-context store can answer (`conv_input`,
`attention_keys_values`; `tts_core.flow.context_pool` answers them for a batch of streams).

One `FrameCache` serves one time base (token rate or mel-frame rate) and one estimator evaluation
(each Euler step has its own). Layers find their state by identity; the cache holds no parameters.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

KeysValues = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class FrameCache:
    def __init__(self) -> None:
        self._left: dict[nn.Module, torch.Tensor] = {}
        self._kv: dict[nn.Module, tuple[torch.Tensor, torch.Tensor]] = {}
        self.start = 0
        self.commit = 0

    def begin(self, commit: int) -> None:
        """Open a pass that starts at `self.start` and keeps state up to `commit`."""
        if commit < self.start:
            raise ValueError(f"frame cache: commit {commit} is before the pass start {self.start}")
        self.commit = commit

    def finish(self) -> None:
        self.start = self.commit

    def left(self, layer: nn.Module, n: int, like: torch.Tensor) -> torch.Tensor:
        """The `n` input frames before `start` (B, C, n); zeros at the sequence start, which is
        exactly the causal zero padding of the full-sequence computation."""
        kept = self._left.get(layer)
        if kept is None:
            return like.new_zeros(like.size(0), like.size(1), n)
        return kept

    def keep_left(self, layer: nn.Module, seq: torch.Tensor, n: int) -> None:
        """`seq` covers frames [start - n, end) on its last axis; keep [commit - n, commit)."""
        at = self.commit - self.start
        self._left[layer] = seq[:, :, at:at + n].clone()  # do not pin the whole pass's input

    def keys_values(self, layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._kv.get(layer)

    def keep_keys_values(self, layer: nn.Module, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (B, H, end, d) cover frames [0, end); keep [0, commit)."""
        self._kv[layer] = (k[:, :, :self.commit], v[:, :, :self.commit])

    def conv_input(self, layer: nn.Module, x: torch.Tensor, n: int) -> torch.Tensor:
        """x (B, C, T) -> (B, C, n + T): the causal convolution's input with its left context."""
        seq = torch.cat([self.left(layer, n, x), x], dim=2)
        self.keep_left(layer, seq, n)
        return seq

    def attention_keys_values(self, layer: nn.Module, x: torch.Tensor,
                              project: KeysValues) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) new frames' attention input -> keys/values of every earlier frame and of x."""
        k, v = project(x)
        earlier = self.keys_values(layer)
        if earlier is not None:
            k, v = torch.cat([earlier[0], k], dim=2), torch.cat([earlier[1], v], dim=2)
        self.keep_keys_values(layer, k, v)
        return k, v
