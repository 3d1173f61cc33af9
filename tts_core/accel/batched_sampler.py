"""Repetition-aware sampling for a whole decode batch in a few GPU kernels and one host copy.

`RasSampler` (tts_core.llm.sampling) draws per request with a host sync per draw; at 100+ live
requests that costs more than the decode step itself. This sampler draws the same distribution for
every row at once:

- nucleus: the top_k most likely tokens in order, kept while the mass before them is < top_p;
- RAS: if the nucleus pick occurs >= win_size * tau_r times in the row's last win_size tokens, the
  pick is redrawn from the full distribution;
- before a row's minimum length, stop tokens (ids >= speech_token_size) are rejected: `trials`
  independent RAS draws are made in parallel and the first non-stop one is taken (the official loop
  draws again until one is; `trials` of them cover all but a vanishing tail, which, like
  `RasSampler`'s fallback, draws from the distribution with stop tokens removed).

Draws use exponential races (argmax p / E, E ~ Exp(1)), which pick index i with probability p_i, on
one `torch.Generator` for the batch: per-request seeding is traded for one launch per step.
"""

from __future__ import annotations

import torch

from tts_core.llm.sampling import SamplingConfig


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Index drawn with probability proportional to `probs` along the last axis."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


class BatchedRasSampler:
    def __init__(self, config: SamplingConfig, speech_token_size: int, trials: int = 4) -> None:
        self.config = config
        self.speech_token_size = speech_token_size
        self.trials = trials

    @torch.inference_mode()
    def sample(self, logp: torch.Tensor, history: torch.Tensor, allow_stop: torch.Tensor,
               generator: torch.Generator | None = None) -> torch.Tensor:
        """logp (B, V); history (B, win_size) last tokens per row, -1 where a row has fewer;
        allow_stop (B,) bool. Returns tokens (B,) long on the logits' device."""
        cfg = self.config
        probs = logp.float().softmax(dim=-1)
        top_p, top_i = probs.topk(cfg.top_k, dim=-1)  # sorted, most likely first
        before = top_p.cumsum(dim=-1) - top_p
        nucleus = torch.where(before < cfg.top_p, top_p, torch.zeros_like(top_p))

        t = self.trials
        rows = probs.shape[0]
        nucleus_t = nucleus.unsqueeze(1).expand(rows, t, -1)
        picks = top_i.gather(1, _race(nucleus_t, generator))  # (B, trials)
        repeats = (history.unsqueeze(1) == picks.unsqueeze(-1)).sum(dim=-1)
        repeated = repeats >= cfg.win_size * cfg.tau_r
        full = _race(probs.unsqueeze(1).expand(rows, t, -1), generator)
        picks = torch.where(repeated, full, picks)

        ok = allow_stop[:, None] | (picks < self.speech_token_size)
        first_ok = ok.float().argmax(dim=1)  # first allowed trial (0 if none is)
        chosen = picks.gather(1, first_ok[:, None])[:, 0]
        masked = probs.clone()
        masked[:, self.speech_token_size:] = 0
        fallback = _race(masked, generator)
        return torch.where(ok.any(dim=1), chosen, fallback)
