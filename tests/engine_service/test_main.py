"""`python -m engine_service` as operators and the gateway's supervisor start it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_taken_port_is_one_error_line_and_exit_1():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        listen = f"127.0.0.1:{holder.getsockname()[1]}"
        done = subprocess.run([sys.executable, "-m", "engine_service", "--engine", "instant", "--listen", listen],
                              cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                              timeout=60)
    assert done.returncode == 1 and done.stdout == ""  # no engine_worker_listening line for a supervisor
    events = [json.loads(line) for line in done.stderr.splitlines()]  # log events only: no traceback
    assert [(e["event"], e["listen"]) for e in events if e["level"] == "error"] == [
        ("engine_worker_listen_failed", listen)]


def _worker_refusing(*arguments: str) -> subprocess.CompletedProcess:
    """A worker started with `arguments` that should refuse to start."""
    return subprocess.run([sys.executable, "-m", "engine_service", "--engine", "instant", *arguments],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)


def test_prepare_texts_that_are_not_a_list_of_strings_name_the_option():
    done = _worker_refusing("--prepare-texts", '{"welcome": "Hello."}')
    assert done.returncode == 2
    assert "--prepare-texts: expected a JSON list of strings" in done.stderr
    # and the supervisor is told why, for the gateway's one-line error
    assert [json.loads(line) for line in done.stdout.splitlines()] == [
        {"event": "engine_worker_refused", "error": "--prepare-texts: expected a JSON list of strings"}]


def test_reserving_every_slot_for_calls_is_one_error_line_and_exit_2():
    done = _worker_refusing("--slots", "4", "--tts-api", '{"reserved_call_slots": 4}')
    assert done.returncode == 2
    assert "tts_api.reserved_call_slots: 4 leaves the speech API none of this worker's 4 slots" in done.stderr
    assert "Traceback" not in done.stderr


def test_bad_http_limits_name_the_key():
    done = _worker_refusing("--http-limits", '{"max_connections": 5, "max_connections_per_source": 9}')
    assert done.returncode == 2
    assert "--http-limits: engine.worker.max_connections_per_source: must not exceed max_connections" in done.stderr
