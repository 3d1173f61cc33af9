"""Open-loop arrivals: when each request of a benchmark run is sent, and which text it asks for.

A Poisson process at rate λ (exponential gaps, mean 1/λ) from a seeded generator, over three phases: a warm-up
(sent, not measured), the measurement window (every request that arrives in it is measured to completion,
however long it takes), and a tail that keeps the same load on the server while the window's requests finish,
so the last measured request does not see a server emptying out. Arrivals never wait for answers: that is what
makes the load open-loop (a closed loop slows its own arrivals when the server is slow, and hides collapse).
Pure: no clocks, no sockets; the runner turns `at_s` into send times.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

WARMUP, WINDOW, TAIL = "warmup", "window", "tail"


@dataclass(frozen=True)
class Arrival:
    index: int
    at_s: float  # seconds after the run's start
    phase: str  # WARMUP, WINDOW or TAIL: only WINDOW arrivals are measured
    prompt_s: float  # which of the run's prompt lengths this request asks for


def poisson_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times in [0, duration_s) of a Poisson process of `rate` per second (seeded: the same times
    for the same seed, whatever else the run does)."""
    if rate <= 0 or duration_s <= 0:
        raise ValueError("rate and duration_s must be positive")
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    gaps = rng.exponential(1.0 / rate, size=int(expected + 10 * np.sqrt(expected) + 20))
    times = np.cumsum(gaps)
    while times[-1] < duration_s:  # rare: more arrivals than the generous draw above
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, size=len(times)))])
    return times[times < duration_s]


def plan_arrivals(rate: float, seed: int, warmup_s: float, window_s: float, tail_s: float,
                  prompts_s: Sequence[float]) -> list[Arrival]:
    """The run's arrivals in time order, each with its phase and a prompt length drawn (seeded, uniformly)
    from `prompts_s`."""
    times = poisson_times(rate, warmup_s + window_s + tail_s, seed)
    picks = np.random.default_rng([seed, 1]).integers(0, len(prompts_s), size=len(times))
    return [Arrival(i, float(t), WARMUP if t < warmup_s else WINDOW if t < warmup_s + window_s else TAIL,
                    float(prompts_s[p])) for i, (t, p) in enumerate(zip(times, picks, strict=True))]
