"""FirstAudioEstimate: how long a stream opened now would wait for its first audio, from what the worker saw.

Pure (times are passed in). Two measured figures, each an exponentially weighted mean:

- `unloaded_s`: open -> first chunk for streams opened while no other stream waited for its first chunk
  (the engine's own first-chunk time);
- `gap_s`: the time between two first chunks while streams were waiting (how fast a backlog drains: one
  job's whole synthesis on a serial engine such as espeak, a fraction of a batch step on cosyvoice2).

The estimate for a new stream is `unloaded_s + waiting * gap_s`. Measured, not modelled, so it holds for a
serial engine (a long prompt ahead blocks everyone: 5 prompts of 2,000 characters made a short call's first
packet 698 ms late, issue #22) and for a batched one alike. Before anything is measured it says 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WEIGHT = 0.2  # of the newest sample: about the last ten streams count


@dataclass
class FirstAudioEstimate:
    unloaded_s: float = 0.0
    gap_s: float = 0.0
    _waiting: dict[int, tuple[float, bool]] = field(default_factory=dict)  # stream -> (opened at, alone)
    _last_first_chunk_at: float | None = None
    _backlog_since_last: bool = False

    @property
    def waiting(self) -> int:
        return len(self._waiting)

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
            self.unloaded_s = _mix(self.unloaded_s, now - opened_at)
        if self._backlog_since_last and self._last_first_chunk_at is not None:
            self.gap_s = _mix(self.gap_s, now - max(self._last_first_chunk_at, opened_at))
        self._last_first_chunk_at = now
        self._backlog_since_last = bool(self._waiting)

    def gone(self, stream: int) -> None:
        """The stream ended, failed or was cancelled before its first chunk: it no longer waits."""
        self._waiting.pop(stream, None)

    def expected_s(self) -> float:
        return self.unloaded_s + self.waiting * self.gap_s


def _mix(mean: float, sample: float) -> float:
    return sample if mean == 0.0 else (1 - WEIGHT) * mean + WEIGHT * sample
