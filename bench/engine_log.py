"""The engine's job lines in a server's JSON log (serve's, or a worker's): what the scheduler logged as each
job ended (`tts_job_done`, `tts_job_cancelled`: its first chunk and where that chunk's time went), read from an
offset so a benchmark takes only the lines of its own step. Shared by bench_e2e_calls and bench_tts_api; and
`serve_events`, any named events of serve's log (workers starting, exiting, connecting; start-up stages), shared
by bench_e2e_calls, bench_open_loop and bench_worker_start."""

from __future__ import annotations

import json
from pathlib import Path

JOB_EVENTS = ("tts_job_done", "tts_job_cancelled")


def job_events(path: Path, offset: int) -> tuple[list[dict], int]:
    """The job events with a first chunk in the complete lines past `offset`, and the offset after them (a line
    still being written is left for the next read). Lines that are not JSON (a traceback) are skipped."""
    with open(path, "rb") as log:
        log.seek(offset)
        data = log.read()
    complete = data[:data.rfind(b"\n") + 1]
    events = []
    for line in complete.splitlines():
        if not any(event.encode() in line for event in JOB_EVENTS):
            continue
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") in JOB_EVENTS and event.get("first_chunk_s") is not None:
            events.append(event)
    return events, offset + len(complete)


def serve_events(log_path: Path, names: tuple[str, ...], offset: int = 0) -> list[dict]:
    """Serve's JSON log events named `names` past `offset` (lines that are not JSON skipped)."""
    out = []
    with open(log_path, "rb") as log:
        log.seek(offset)
        for line in log.read().splitlines():
            if not line.startswith(b"{") or not any(n.encode() in line for n in names):
                continue
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") in names:
                out.append(event)
    return out
