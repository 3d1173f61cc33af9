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


def test_version_comes_from_the_package_metadata():
    from importlib.metadata import version

    done = run("--version")
    assert done.returncode == 0 and done.stdout.strip() == f"cosyvoice-gateway {version('cosyvoice-gateway')}"


@pytest.fixture()
def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    from tests.tts_core.onnx_standins import model_dir_for_enrolment

    return model_dir_for_enrolment(tiny_model_dir, tmp_path / "model")


def test_voice_add_list_replace_remove(model_copy: Path, golden_dir: Path, tmp_path: Path):
    prompt = str(golden_dir / "cases" / "prompt_16k.wav")
    added = run("voice", "add", "alice", "--wav", prompt, "--text", "Hello, this is Alice.", "--model-dir", str(model_copy))
    assert added.returncode == 0, added.stderr
    # The running gateway does not see it until a restart, and the command says so.
    assert "restart the gateway (systemctl restart cosyvoice-gateway)" in added.stdout
    voice_file = model_copy / "voices" / "alice.pt"
    before = voice_file.read_bytes()

    again = run("voice", "add", "alice", "--wav", prompt, "--text", "Other words.", "--model-dir", str(model_copy))
    assert again.returncode == 1 and voice_file.read_bytes() == before
    assert again.stderr.strip() == (f"cosyvoice-gateway: voice 'alice' already exists ({voice_file}); "
                                    "add --replace to overwrite it")

    listed = run("voice", "list", "--model-dir", str(model_copy))
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line for line in listed.stdout.splitlines()}
    assert set(rows) == {"golden_speaker", "alice"}
    assert "3.0 s" in rows["alice"] and "'Hello, this is Alice.'" in rows["alice"] and str(voice_file) in rows["alice"]

    replaced = run("voice", "add", "alice", "--wav", prompt, "--text", "Other words.", "--model-dir",
                   str(model_copy), "--replace")
    assert replaced.returncode == 0 and "'Other words.'" in run("voice", "list", "--model-dir", str(model_copy)).stdout

    removed = run("voice", "remove", "alice", "--model-dir", str(model_copy))
    assert removed.returncode == 0 and not voice_file.exists()
    assert "restart the gateway" in removed.stdout
    shipped = run("voice", "remove", "golden_speaker", "--model-dir", str(model_copy))
    assert shipped.returncode == 1 and "comes with the model" in shipped.stderr
    assert len(shipped.stderr.strip().splitlines()) == 1


def test_voice_add_refuses_a_20_second_prompt_with_the_reason(model_copy: Path, tmp_path: Path):
    from tests.tts_core.test_voices import speechlike, write_wav

    wav = write_wav(tmp_path / "long.wav", speechlike(20))
    done = run("voice", "add", "bob", "--wav", str(wav), "--text", "words", "--model-dir", str(model_copy))
    assert done.returncode == 1 and not (model_copy / "voices").exists()
    assert done.stderr.strip() == (f"cosyvoice-gateway: voice 'bob' not added: {wav}: prompt is 20.0 s; give 1-12 s "
                                   "of the speaker (3-10 s of clean speech works best)")


def test_voice_add_reports_a_clear_error(tmp_path):
    done = run("voice", "add", "alice", "--wav", str(tmp_path / "a.wav"), "--text", "hello",
               "--model-dir", str(tmp_path))
    assert done.returncode in (1, 2)
    assert done.stderr.startswith("cosyvoice-gateway: ") and len(done.stderr.strip().splitlines()) == 1


def test_call_reports_an_unanswered_call():
    pytest.importorskip("pjsua2")
    # Nothing listens on this port: the phone hangs up at its timeout (PJSIP reports 487 for that).
    done = run("call", "sip:1000@127.0.0.1:9", "--text", "hello", "--timeout", "3")
    assert done.returncode == 1
    assert done.stdout.strip() == "not answered: no answer from 127.0.0.1:9 within 3 s"
