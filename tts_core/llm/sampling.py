"""Repetition-aware sampling of speech tokens (VALL-E 2's RAS, as CosyVoice2 configures it).

Per step: draw from the nucleus (the most likely tokens, in order, while the probability taken so
far is below top_p and fewer than top_k are taken). If that pick already occurs at least
win_size * tau_r times among the last win_size tokens, draw again from the full distribution
instead; this breaks the loops a speech LM falls into. Before the minimum length a stop token
(any id >= speech_token_size: eos, and the two bistream tokens) is rejected and drawn again, as the
official `sampling_ids` does.

All randomness comes from the caller's `torch.Generator` (one per request, on the logits' device):
never from global RNG state, so concurrent requests neither disturb nor correlate with each other.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class SamplingConfig:
    top_p: float = 0.8
    top_k: int = 25
    win_size: int = 10
    tau_r: float = 0.1

    @classmethod
    def from_yaml(cls, llm_section: Mapping[str, Any]) -> SamplingConfig:
        """From the yaml's `llm:` mapping (its `sampling: !name:...ras_sampling` entry)."""
        raw = llm_section.get("sampling") or {}
        default = cls()
        return cls(
            top_p=float(raw.get("top_p", default.top_p)),
            top_k=int(raw.get("top_k", default.top_k)),
            win_size=int(raw.get("win_size", default.win_size)),
            tau_r=float(raw.get("tau_r", default.tau_r)),
        )


def nucleus_sample(logp: torch.Tensor, top_p: float, top_k: int, generator: torch.Generator) -> int:
    """One draw from the top-p/top-k nucleus of `logp` (V,)."""
    probs, order = logp.softmax(dim=0).sort(descending=True, stable=True)
    taken_before = torch.cumsum(probs, dim=0) - probs
    # Official rule: keep taking while the mass taken so far is < top_p and fewer than top_k are taken.
    keep = (taken_before < top_p) & (torch.arange(probs.shape[0], device=probs.device) < top_k)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return int(order[torch.multinomial(kept, 1, generator=generator)].item())


def random_sample(logp: torch.Tensor, generator: torch.Generator) -> int:
    return int(torch.multinomial(logp.softmax(dim=0), 1, generator=generator).item())


class RasSampler:
    """Stateless apart from its settings: the caller keeps each request's history and generator."""

    def __init__(self, config: SamplingConfig, speech_token_size: int, max_trials: int = 100) -> None:
        self.config = config
        self.speech_token_size = speech_token_size
        self.max_trials = max_trials

    def ras(self, logp: torch.Tensor, history: Sequence[int], generator: torch.Generator) -> int:
        cfg = self.config
        pick = nucleus_sample(logp, cfg.top_p, cfg.top_k, generator)
        window = history[-cfg.win_size:] if cfg.win_size > 0 else []
        if sum(1 for t in window if t == pick) >= cfg.win_size * cfg.tau_r:
            pick = random_sample(logp, generator)
        return pick

    def sample(self, logp: torch.Tensor, history: Sequence[int], generator: torch.Generator,
               allow_stop: bool) -> int:
        """Next token from `logp` (V,) given the tokens generated so far."""
        for _ in range(self.max_trials + 1):
            pick = self.ras(logp, history, generator)
            if allow_stop or pick < self.speech_token_size:
                return pick
        # The official code raises here. A phone call is better served by a speech token: draw one
        # with the stop tokens removed, which is what the rejections were converging to anyway.
        log.warning("tts_llm_stop_rejection_exhausted", trials=self.max_trials)
        masked = logp.clone()
        masked[self.speech_token_size:] = float("-inf")
        return random_sample(masked, generator)
