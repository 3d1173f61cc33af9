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


def test_prepare_texts_that_are_not_a_list_of_strings_name_the_option():
    done = subprocess.run([sys.executable, "-m", "engine_service", "--engine", "instant",
                           "--prepare-texts", '{"welcome": "Hello."}'],
                          cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "--prepare-texts: expected a JSON list of strings" in done.stderr
    # and the supervisor is told why, for the gateway's one-line error
    assert [json.loads(line) for line in done.stdout.splitlines()] == [
        {"event": "engine_worker_refused", "error": "--prepare-texts: expected a JSON list of strings"}]
