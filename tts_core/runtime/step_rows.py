"""Which generating jobs take part in the next decode step: deadline-aware decoding.

Every job knows how far its speech runs ahead of its listener (`SynthesisJob.lead_s`: audio handed out
and not yet played, plus its decoded tokens not yet rendered). The LM decodes many times faster than
real time, so a stream a second or two past its first chunk is soon tens of seconds ahead; stepping it
then buys nothing, while its rows and steps share the GPU with a new call that waits in silence. So,
while some live job (`JobOptions.paced`) still waits for its first chunk (a caller hears nothing yet):
- a stream more than `yield_lead_s` ahead skips the step; it steps again once its lead has fallen to
  that bound, whatever else is waiting, so it is never starved (its lead falls at one second per second,
  and a step adds a token's worth);
- a live job whose first chunk's tokens are all drawn is held while that chunk renders
  (`SynthesisJob.held_for_first_chunk`, `first_chunk_hold_s`); if every live job left to step is held
  (or none is left and one is held), no step runs and the render has the GPU. Unpaced jobs left to step
  wait with them (for at most `first_chunk_hold_s`): a live call never waits for a file.
With no live first chunk pending, every generating job steps (big batches: the cheapest way to get
ahead). An unpaced job (audio collected whole: a play-URL miss, a prerender, a level calibration) never
makes others yield or pause, nor is it held for its own first chunk: nobody hears that chunk as it
comes, and the file needs its next tokens at once.

Pure logic on the jobs' state, called under the scheduler's lock; it never touches the device.
"""

from __future__ import annotations

from collections.abc import Sequence

from tts_core.runtime.request import SynthesisJob
from tts_core.streaming.chunk_schedule import ChunkSchedule


def yield_bound_s(yield_lead_s: float, defer_slack_s: float, schedule: ChunkSchedule, token_s: float) -> float:
    """The lead past which a stream yields (`step_rows`'s `yield_lead_s`): the setting, raised where the
    schedule's longest hop needs more. A stream that yielded must already hold its next chunk's tokens (a hop
    and the lookahead) when that chunk falls due, `defer_slack_s` before its audio runs out; at CosyVoice2's
    50-token hop that is 2.9 s (the measured 4 s stands), at CosyVoice3's 100 it is 4.9 s. 0 stays off."""
    if yield_lead_s <= 0:
        return 0.0
    return max(yield_lead_s, defer_slack_s + (schedule.max_hop_tokens + schedule.lookahead_tokens) * token_s)


def step_rows(jobs: Sequence[SynthesisJob], now: float, hold_s: float, yield_lead_s: float,
              token_s: float) -> tuple[list[SynthesisJob], float | None]:
    """(the jobs that step now, seconds until one will when none does: None when that waits on
    another thread's wake: a token, a hand-off, a new job)."""
    generating = [job for job in jobs if job.generating]
    if not generating:
        return [], None
    waiting = [job for job in jobs
               if job.options.paced and job.timings.first_chunk is None and job.slot is not None
               and not job.cancelled]
    if not waiting:
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
        held = {job: job.held_for_first_chunk(now, hold_s) for job in waiting}
        live_rows = [job for job in rows if job.options.paced]
        if any(left > 0 for left in held.values()) and all(held.get(job, 0.0) > 0 for job in live_rows):
            resume.extend(left for left in held.values() if left > 0)
            rows = []
    return rows, (min(resume) if not rows and resume else None)
