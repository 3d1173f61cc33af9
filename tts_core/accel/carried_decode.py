"""Decode steps whose next input stays on the device, so the host can launch step k+1 before it has
read step k's tokens.

The scheduler's decode step used to round-trip through the host: build each row's input token and
RAS window from `job.tokens`, copy them up, replay, copy the drawn tokens down and wait. Under load
on the H100 (docs/PERF_NOTES.md, 17 req/s) the decode stream
ran kernels for 3.5 ms of each 14 ms between steps: the rest was the host (its Python beside three
render threads, the scheduler's lock, a graph launch lock since removed, the wait itself). Here each cache slot
keeps its last drawn token and its RAS window on the device (`SlotTokens`); a step gathers them by
slot, draws, and writes them back, all inside one replay. The host only says which slots step and
which may stop, and reads the drawn tokens one step later (`PendingTokens`), while the next step
already runs: the GPU no longer waits for the host between steps, as long as the host's work per
step is shorter than the step.

A row keeps stepping until the host has read the token that ends it: the step after a stop token
is drawn and thrown away (its cache write lands past the row's last position, which the next
prefill of the slot overwrites). A slot's state is set when its segment starts: by `draw_first`
on the device, from the prefill's logp (the scheduler runs prefills on a stream of their own, so a
new call's prefill does not stall the steps of the calls already speaking), or from the host (`seed`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tts_core.accel.batched_sampler import BatchedRasSampler
from tts_core.host_copy import to_device
from tts_core.llm.speech_lm import SpeechTokenLM


class SlotTokens:
    """Per cache slot, on the device: the last drawn token (the next step's input) and the last
    `window` tokens (-1 where fewer were drawn), which the RAS rule counts repeats in."""

    def __init__(self, slots: int, window: int, device: torch.device) -> None:
        self.window = window
        self.last = torch.zeros(slots, dtype=torch.long, device=device)
        self.history = torch.full((slots, max(window, 1)), -1, dtype=torch.long, device=device)

    def seed(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        """Set each slot's state from the host: its tokens so far (at least one each)."""
        if not slots:
            return
        if any(not t for t in tokens):
            raise ValueError("SlotTokens.seed: every slot needs at least one token")
        width = self.history.shape[1]
        device = self.last.device
        rows = to_device([([-1] * width + list(t))[-width:] for t in tokens], torch.long, device)
        index = to_device(slots, torch.long, device)
        self.history.index_copy_(0, index, rows)
        self.last.index_copy_(0, index, rows[:, -1].contiguous())

    def gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(input tokens (B,), RAS windows (B, window)) of the rows' slots."""
        return self.last.index_select(0, slots), self.history.index_select(0, slots)

    def advance(self, slots: torch.Tensor, history: torch.Tensor, drawn: torch.Tensor) -> None:
        """After a draw: each row's token becomes its slot's next input and joins its window.
        Padding rows all name one scratch slot; whichever of them lands last is as good as any."""
        self.last[slots] = drawn
        self.history[slots] = torch.cat([history[:, 1:], drawn[:, None]], dim=1)


def _to_host(drawn: torch.Tensor) -> PendingTokens:
    """`drawn` copied to the host behind the work queued so far on the current stream."""
    if drawn.device.type != "cuda":
        return PendingTokens(drawn.cpu(), drawn.shape[0])
    host = torch.empty(drawn.shape, dtype=drawn.dtype).pin_memory()
    host.copy_(drawn, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return PendingTokens(host, drawn.shape[0], event)


@torch.inference_mode()
def draw_first(state: SlotTokens, sampler: BatchedRasSampler, logp: torch.Tensor, slots: Sequence[int],
               allow_stop: Sequence[bool], generator: torch.Generator | None) -> PendingTokens:
    """A segment's first token for each slot from its prefill's logp (B, V), drawn on the device
    with an empty RAS window; it becomes the slot's carried state. On the current stream."""
    device = state.last.device
    index = to_device(slots, torch.long, device)
    history = torch.full((len(slots), state.history.shape[1]), -1, dtype=torch.long, device=device)
    drawn = sampler.sample(logp, history, to_device(allow_stop, torch.bool, device), generator)
    state.advance(index, history, drawn)
    return _to_host(drawn)


class PendingTokens:
    """The drawn tokens of one launched step, on their way to the host."""

    def __init__(self, host: torch.Tensor, live: int, event: torch.cuda.Event | None = None) -> None:
        self._host, self._live, self._event = host, live, event

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def result(self) -> list[int]:
        """Wait for the step (the GIL is released while waiting) and return its live rows' tokens."""
        if self._event is not None:
            self._event.synchronize()
        return self._host[:self._live].tolist()


class EagerCarriedDecoder:
    """`GraphedDecoder(carry=True)`'s contract without graphs (CPU, or CUDA without capture): each
    launch runs the step eagerly and its tokens are ready at once."""

    def __init__(self, lm: SpeechTokenLM, sampler: BatchedRasSampler, seed: int = 0) -> None:
        cache = lm.kv_cache
        if cache is None:
            raise RuntimeError("EagerCarriedDecoder: call lm.setup_cache(max_batch, max_len) first")
        self.lm, self.sampler, self.cache = lm, sampler, cache
        self.state = SlotTokens(cache.max_batch, sampler.config.win_size, cache.device)
        # Its own generator: draws do not depend on what other threads take from the global one.
        self.generator = torch.Generator(device=cache.device).manual_seed(seed)

    def seed(self, slots: Sequence[int], tokens: Sequence[Sequence[int]]) -> None:
        self.state.seed(slots, tokens)

    def draw_first(self, slots: Sequence[int], logp: torch.Tensor, allow_stop: Sequence[bool]) -> PendingTokens:
        return draw_first(self.state, self.sampler, logp, slots, allow_stop, self.generator)

    @torch.inference_mode()
    def launch(self, slots: Sequence[int], allow_stop: Sequence[bool], kv_len: int) -> PendingTokens:
        device = self.cache.device
        slots_t = to_device(slots, torch.long, device)
        allow = to_device(allow_stop, torch.bool, device)
        tokens, history = self.state.gather(slots_t)
        logp = self.lm.decode_step(slots_t, tokens, self.cache.attend_len(kv_len))
        drawn = self.sampler.sample(logp, history, allow, self.generator)
        self.state.advance(slots_t, history, drawn)
        return PendingTokens(drawn.cpu(), len(slots_t))
