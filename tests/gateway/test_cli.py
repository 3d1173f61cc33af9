"""The command line as an operator runs it: the installed `cosyvoice-gateway` script in a subprocess."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = shutil.which("cosyvoice-gateway") or str(Path(sys.executable).parent / "cosyvoice-gateway")


def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([SCRIPT, *args], capture_output=True, text=True, timeout=timeout)


def test_serve_with_a_bad_config_exits_2_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sip:\n  listen: 127.0.0.1:5060\nroutes:\n  - match: '1000'\n    text: hi\n    colour: red\n")
    done = run("serve", "--config", str(bad))
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "routes[0].colour: unknown field" in lines[0]


def test_serve_overrides_are_validated_like_the_file():
    done = run("serve", "--sip-listen", "nowhere")
    assert done.returncode == 2
    assert "sip.listen: expected HOST:PORT" in done.stderr


def test_serve_set_overrides_are_validated_like_the_file():
    done = run("serve", "--set", "media.inactivity_timeout_s=-1")
    assert done.returncode == 2
    assert "media.inactivity_timeout_s: Input should be greater than or equal to 0" in done.stderr
    done = run("serve", "--set", "sip.max_calls")
    assert done.returncode == 2 and "--set sip.max_calls: expected KEY=VALUE" in done.stderr


def test_serve_with_a_missing_file_exits_2(tmp_path):
    done = run("serve", "--config", str(tmp_path / "absent.yaml"))
    assert done.returncode == 2 and "absent.yaml: cannot read" in done.stderr


def test_voice_add_reports_a_clear_error(tmp_path):
    done = run("voice", "add", "alice", "--wav", str(tmp_path / "a.wav"), "--text", "hello",
               "--model-dir", str(tmp_path))
    assert done.returncode in (1, 2)
    assert done.stderr.startswith("cosyvoice-gateway: ") and len(done.stderr.strip().splitlines()) == 1


def test_call_reports_an_unanswered_call():
    pytest.importorskip("pjsua2")
    # Nothing listens on this port: the INVITE times out (408) or is refused.
    done = run("call", "sip:1000@127.0.0.1:9", "--text", "hello", "--timeout", "3")
    assert done.returncode == 1
    assert "not answered" in done.stdout
