"""Which generating jobs take part in the next decode step: deadline-aware decoding.

Every job knows how far its speech runs ahead of its listener (`SynthesisJob.lead_s`: audio handed out
and not yet played, plus its decoded tokens not yet rendered). The LM decodes many times faster than
real time, so a stream a second or two past its first chunk is soon tens of seconds ahead; stepping it
then buys nothing, while its rows and steps share the GPU with a new call that waits in silence. So,
while some job still waits for its first chunk (a caller hears nothing yet):
- a stream more than `yield_lead_s` ahead skips the step; it steps again once its lead has fallen to
  that bound, whatever else is waiting, so it is never starved (its lead falls at one second per second,
  and a step adds a token's worth);
- a job whose first chunk's tokens are all drawn is held while that chunk renders
  (`SynthesisJob.held_for_first_chunk`, `first_chunk_hold_s`); if every job left to step is held, no
  step runs and the render has the GPU.
With no first chunk pending, every generating job steps (big batches: the cheapest way to get ahead).

Pure logic on the jobs' state, called under the scheduler's lock; it never touches the device.
"""

from __future__ import annotations

from collections.abc import Sequence

from tts_core.runtime.request import SynthesisJob


def step_rows(jobs: Sequence[SynthesisJob], now: float, hold_s: float, yield_lead_s: float,
              token_s: float) -> tuple[list[SynthesisJob], float | None]:
    """(the jobs that step now, seconds until one will when none does: None when that waits on
    another thread's wake: a token, a hand-off, a new job)."""
    generating = [job for job in jobs if job.generating]
    if not generating:
        return [], None
    pressing = any(job.timings.first_chunk is None and job.slot is not None and not job.cancelled for job in jobs)
    if not pressing:
        return generating, None
    rows, resume = [], []
    for job in generating:
        if yield_lead_s > 0 and job.timings.first_chunk is not None:
            ahead = job.lead_s(now, token_s) - yield_lead_s
            if ahead > 0:
                resume.append(ahead)
                continue
        rows.append(job)
    if hold_s > 0 and rows:
        held = [job.held_for_first_chunk(now, hold_s) for job in rows]
        if all(left > 0 for left in held):
            resume.extend(held)
            rows = []
    return rows, (min(resume) if not rows and resume else None)
