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


def test_a_worker_listening_beyond_loopback_without_a_token_refuses_in_one_line():
    """Anything that reaches such a port could synthesise without an API key (issue #33 item 5)."""
    done = _worker_refusing("--listen", "0.0.0.0:0")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "engine_service: --listen 0.0.0.0:0: beyond loopback the engine link needs a token, or anyone who reaches "
        "the port can synthesise: start with --token-file PATH (gateways send it as engine.remote.token)"]
    assert json.loads(done.stdout)["event"] == "engine_worker_refused"


def test_an_empty_token_file_is_no_token(tmp_path):
    token_file = tmp_path / "engine.token"
    token_file.write_text("\n")
    done = _worker_refusing("--listen", "0.0.0.0:0", "--token-file", str(token_file))
    assert done.returncode == 2 and "needs a token" in done.stderr


def _started(*arguments: str, stdin: str = "") -> tuple[dict, list[dict]]:
    """A worker's listening line and its stderr events up to it, then SIGTERM."""
    process = subprocess.Popen([sys.executable, "-m", "engine_service", "--engine", "instant", *arguments],
                               cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        process.stdin.write(stdin)
        process.stdin.flush()
        listening = json.loads(process.stdout.readline())
    finally:
        process.terminate()
        _, err = process.communicate(timeout=30)
    return listening, [json.loads(line) for line in err.splitlines()]


def test_a_loopback_worker_without_a_token_starts_and_warns_and_one_with_a_token_does_not():
    listening, events = _started("--listen", "127.0.0.1:0")
    assert listening["event"] == "engine_worker_listening"
    warned = [e for e in events if e["event"] == "engine_worker_link_without_token"]
    assert len(warned) == 1 and warned[0]["level"] == "warning" and warned[0]["url"] == listening["url"]
    _, events = _started("--listen", "0.0.0.0:0", "--token-file", "-", stdin="a-long-random-secret\n")
    assert [e["event"] for e in events if e["level"] == "warning"] == []


def test_a_dependency_missing_from_the_installation_is_one_refusal_line_not_a_traceback(tmp_path):
    """A GPU host once lacked lameenc (a dependency the speech API gained): every worker died at import with a
    traceback and exit 1, retried for good. A broken install is refused like bad settings: one line, exit 2."""
    (tmp_path / "lameenc.py").write_text("raise ImportError('No module named lameenc (removed for this test)')\n")
    done = subprocess.run([sys.executable, "-m", "engine_service", "--engine", "instant"], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}:{REPO}"}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "lacks what the worker needs" in done.stderr and "lameenc" in done.stderr
    assert json.loads(done.stdout.splitlines()[-1])["event"] == "engine_worker_refused"
