"""A model's identity changes with any of its files, so the prompt cache never plays audio of another model."""

from __future__ import annotations

import os

from speech_audio.model_identity import files_identity


def test_a_new_checkpoint_or_voice_changes_the_identity_and_nothing_else_does(tmp_path):
    model, voices = tmp_path / "model", tmp_path / "voices"
    model.mkdir()
    voices.mkdir()
    (model / "llm.pt").write_bytes(b"weights")
    (voices / "alice.pt").write_bytes(b"prompt")
    first = files_identity("cosyvoice2", model, voices)
    assert files_identity("cosyvoice2", model, voices) == first  # stable across calls (and restarts)

    (model / "llm.pt").write_bytes(b"weights, retrained")
    retrained = files_identity("cosyvoice2", model, voices)
    assert retrained != first

    (voices / "bob.pt").write_bytes(b"another prompt")  # a voice enrolled
    enrolled = files_identity("cosyvoice2", model, voices)
    assert enrolled != retrained

    stat = (voices / "alice.pt").stat()
    os.utime(voices / "alice.pt", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))  # replaced in place
    assert files_identity("cosyvoice2", model, voices) != enrolled
    assert files_identity("espeak", model, voices) != files_identity("cosyvoice2", model, voices)
