"""`cosyvoice-gateway doctor`'s look into a CosyVoice2 model directory: every file the engine opens is there and
each state dict loads strictly into its module (on CPU, nothing kept), and the voices the engine would load.
gateway/doctor.py reaches tts_core only through here. Never used on the serving path."""

from __future__ import annotations

from pathlib import Path


def check_model_dir(model_dir: str | Path) -> str:
    """A one-line summary of a usable directory; raises (FileNotFoundError, ValueError, RuntimeError, ...) with
    the file and the problem named when the engine could not start from it."""
    from tts_core.flow.model import load_flow
    from tts_core.hift.generator import load_hift
    from tts_core.model_dir import ModelDir, load_speech_lm

    directory = ModelDir.open(model_dir)  # the yaml, the Qwen2 folder and its tokenizer files, llm/flow/hift
    # Each part is built, loaded strictly and dropped at once: a doctor must not hold the whole model.
    load_speech_lm(directory)
    load_flow(directory.root)
    load_hift(directory.root)
    size = sum(path.stat().st_size for path in Path(model_dir).rglob("*") if path.is_file())
    return f"llm.pt, flow.pt, hift.pt load with every key matching ({size / 1e9:.2f} GB in the directory)"


def voice_problems(model_dir: str | Path, voices_dir: str | Path | None) -> tuple[int, list[str]]:
    """(voices the engine would load, 'name: problem' for each it would refuse)."""
    from tts_core.voice_files import list_voices

    voices = list_voices(model_dir, voices_dir)
    return len(voices), [f"{voice.name}: {voice.problem}" for voice in voices if voice.problem]
