"""FirstAudioEstimate: how long a stream opened now would wait for its first audio, from what the worker saw.

Pure (times are passed in). Two measured figures, each an exponentially weighted mean:

- `unloaded_s`: open -> first chunk for streams opened while no other stream waited for its first chunk
  (the engine's own first-chunk time);
- `gap_s`: the time between two first chunks while streams were waiting (how fast a backlog drains: one
  job's whole synthesis on a serial engine such as espeak, a fraction of a batch step on cosyvoice2).

The estimate for a new stream is `unloaded_s + waiting * gap_s`. Measured, not modelled, so it holds for a
serial engine (a long prompt ahead blocks everyone: 5 prompts of 2,000 characters made a short call's first
packet 698 ms late, issue #22) and for a batched one alike. Before anything is measured it says 0.

A measurement fades with its age: its weight halves every `HALF_LIFE_S`, both in the estimate (which falls
toward 0, "nothing known", while no new sample comes) and in the mix with the next sample (a sample after a
long quiet spell mostly replaces the old mean instead of being dragged by it). Without this a single stall
(0.8 s on a worker's first stream, issue #31) put the estimate over the gateway's bound for good: no stream
was placed there again, so nothing measured it again. Now such a worker is chosen again once the stall has
faded below the bound, and that stream's first chunk says how it is now. A worker that really is slow gets
one stream per fade to show it, then is avoided again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT = 0.2  # of the newest sample: about the last ten streams count
HALF_LIFE_S = 5.0  # a measurement's weight halves every 5 s: a 0.8 s stall is under a 400 ms bound after 5 s


@dataclass
class _FadingMean:
    """An exponentially weighted mean whose weight also halves every HALF_LIFE_S since its last sample."""

    value: float = 0.0
    at: float | None = None  # when the last sample came

    def now(self, now: float) -> float:
        return 0.0 if self.at is None else self.value * _fade(now - self.at)

    def add(self, sample: float, now: float) -> None:
        if self.at is None:
            self.value = sample
        else:
            kept = (1 - WEIGHT) * _fade(now - self.at)  # the old mean's share: less the older it is
            self.value = kept * self.value + (1 - kept) * sample
        self.at = now


@dataclass
class FirstAudioEstimate:
    _unloaded: _FadingMean = field(default_factory=_FadingMean)
    _gap: _FadingMean = field(default_factory=_FadingMean)
    _waiting: dict[int, tuple[float, bool]] = field(default_factory=dict)  # stream -> (opened at, alone)
    _last_first_chunk_at: float | None = None
    _backlog_since_last: bool = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def unloaded_s(self, now: float) -> float:
        return self._unloaded.now(now)

    def gap_s(self, now: float) -> float:
        return self._gap.now(now)

    def opened(self, stream: int, now: float) -> None:
        self._waiting[stream] = (now, not self._waiting)
        if len(self._waiting) > 1:
            self._backlog_since_last = True

    def first_chunk(self, stream: int, now: float) -> None:
        entry = self._waiting.pop(stream, None)
        if entry is None:
            return
        opened_at, alone = entry
        if alone:
            self._unloaded.add(now - opened_at, now)
        if self._backlog_since_last and self._last_first_chunk_at is not None:
            self._gap.add(now - max(self._last_first_chunk_at, opened_at), now)
        self._last_first_chunk_at = now
        self._backlog_since_last = bool(self._waiting)

    def gone(self, stream: int) -> None:
        """The stream ended, failed or was cancelled before its first chunk: it no longer waits."""
        self._waiting.pop(stream, None)

    def expected_s(self, now: float) -> float:
        return self.unloaded_s(now) + self.waiting * self.gap_s(now)


def _fade(age_s: float) -> float:
    return 0.5 ** (max(age_s, 0.0) / HALF_LIFE_S)
