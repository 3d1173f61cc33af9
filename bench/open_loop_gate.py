"""The open-loop benchmark's verdict: each request's outcome as its client lived it, a run's figures, and the
gate (zero underruns, zero gaps over 60 ms, nothing refused or unfinished, first audible audio p95 within the
bound). Shared by the SIP and the speech-API sides of bench_open_loop.py; pure, no I/O.

A client's playback buffer (the speech API's underrun): playback starts at the first audible audio and plays
one second of audio per second from there; a chunk that arrives after playback reached the audio before it is
an underrun (the buffer ran dry), and playback stalls until that chunk is there (as a player would: the stall
is kept, so one late chunk counts once, not once per chunk after it). Audio after the stream's last chunk is
played out, never an underrun.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

GAP_MS = 60.0  # an RTP gap a phone's jitter buffer (typically 40-60 ms) cannot hide
FIRST_AUDIO_P95_MS = 300.0  # issue #35's bound on first audible audio p95


@dataclass(frozen=True)
class Outcome:
    """One measured request: answered or refused, when it became audible, and what went wrong after."""

    refusal: str | None = None  # "503 at_capacity", "timeout", ...; None when answered
    first_audible_ms: float | None = None  # request sent -> first audible audio received; None: never audible
    x_real_time: float | None = None  # audio received / (last audio received - request sent)
    underruns: int = 0  # the playback buffer ran dry (API: the client's model; SIP: the gateway's, per call)
    gaps_over_60ms: int = 0  # RTP arrival intervals over GAP_MS (SIP)
    rtp_intervals_ms: tuple[float, ...] = ()  # SIP: every arrival interval of the call


def playback_underruns(chunks: Sequence[tuple[float, float]], play_from_s: float,
                       audible_audio_s: float) -> tuple[int, float]:
    """Underruns and seconds stalled of a player fed `chunks` (arrival time s, audio seconds received once that
    chunk is in), starting at `play_from_s` from audio position `audible_audio_s`."""
    underruns, stalled = 0, 0.0
    received = 0.0
    for at, received_after in chunks:
        if at > play_from_s and received > audible_audio_s:
            dry_at = play_from_s + stalled + (received - audible_audio_s)  # when playback reached `received`
            if at > dry_at:
                underruns += 1
                stalled += at - dry_at
        received = received_after
    return underruns, stalled


def _pct(values: Sequence[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 1) if len(values) else None


def run_figures(outcomes: Sequence[Outcome], window_underruns: int | None = None,
                max_first_audio_p95_ms: float = FIRST_AUDIO_P95_MS) -> dict:
    """One (rate, seed) run's figures and its gate. `window_underruns`: the server's own count over the
    measurement window (the gateway's gateway_playout_underruns_total delta, all calls then playing), or None
    where the server has none."""
    answered = [o for o in outcomes if o.refusal is None]
    refusals: dict[str, int] = {}
    for o in outcomes:
        if o.refusal is not None:
            refusals[o.refusal] = refusals.get(o.refusal, 0) + 1
    first = [o.first_audible_ms for o in answered if o.first_audible_ms is not None]
    xrt = [o.x_real_time for o in answered if o.x_real_time is not None]
    intervals = [i for o in answered for i in o.rtp_intervals_ms]
    figures = {
        "measured": len(outcomes), "answered": len(answered), "refused": sum(refusals.values()),
        "refusals": refusals, "never_audible": len(answered) - len(first),
        "first_audible_p50_ms": _pct(first, 50), "first_audible_p95_ms": _pct(first, 95),
        "first_audible_p99_ms": _pct(first, 99), "first_audible_max_ms": _pct(first, 100),
        "x_real_time_p50": None if not xrt else round(float(np.percentile(xrt, 50)), 3),
        "x_real_time_min": None if not xrt else round(min(xrt), 3),
        "underruns": sum(o.underruns for o in answered),
        "requests_with_underruns": sum(1 for o in answered if o.underruns),
        "gaps_over_60ms": sum(o.gaps_over_60ms for o in answered),
        "window_underruns_server": window_underruns,
    }
    if intervals:
        figures["rtp_interval_p99_ms"] = _pct(intervals, 99)
        figures["rtp_interval_max_ms"] = _pct(intervals, 100)
    why = []
    if not outcomes:
        why.append("no request arrived in the window")
    if refusals:
        why.append(f"{figures['refused']} refused or unfinished")
    if figures["never_audible"]:
        why.append(f"{figures['never_audible']} never audible")
    if figures["underruns"] or window_underruns:
        why.append(f"underruns: {figures['underruns']} in measured requests, {window_underruns or 0} in the window")
    if figures["gaps_over_60ms"]:
        why.append(f"{figures['gaps_over_60ms']} RTP gaps over {GAP_MS:g} ms")
    p95 = figures["first_audible_p95_ms"]
    if p95 is not None and p95 > max_first_audio_p95_ms:
        why.append(f"first audible p95 {p95} ms > {max_first_audio_p95_ms:g} ms")
    figures["gate"] = "pass" if not why else "fail"
    figures["gate_failed_on"] = why
    return figures


def highest_passing_rate(rows: Sequence[dict]) -> float | None:
    """The highest rate at which every seed passed the gate, with every lower rate passing too (a curve that
    passes again above a failure is noise, not headroom)."""
    best = None
    for rate in sorted({row["rate_per_s"] for row in rows}):
        if all(row["gate"] == "pass" for row in rows if row["rate_per_s"] == rate):
            best = rate
        else:
            break
    return best
