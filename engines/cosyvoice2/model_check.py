"""`cosyvoice-gateway doctor`'s look into a CosyVoice2 or CosyVoice3 model directory (the family is read from it): every
file the engine opens is there and each state dict loads strictly into its module (on CPU, nothing kept), and the
voices the engine would load. gateway/doctor.py reaches tts_core only through here. Never used on the serving path."""

from __future__ import annotations

from pathlib import Path


def check_model_dir(model_dir: str | Path) -> str:
    """A one-line summary of a usable directory; raises (FileNotFoundError, ValueError, RuntimeError, ...) with
    the file and the problem named when the engine could not start from it."""
    from tts_core.flow.dit_flow import load_dit_flow
    from tts_core.flow.model import load_flow
    from tts_core.hift.causal import load_causal_hift
    from tts_core.hift.generator import load_hift
    from tts_core.model_dir import ModelDir, load_speech_lm, load_speech_lm3

    directory = ModelDir.open(model_dir)  # the yaml, the Qwen2 folder and its tokenizer files, llm/flow/hift
    version = directory.family.version
    loaders = ((load_speech_lm3, load_dit_flow, load_causal_hift) if version == 3
               else (load_speech_lm, load_flow, load_hift))
    # Each part is built, loaded strictly and dropped at once: a doctor must not hold the whole model.
    for load in loaders:
        load(directory if load in (load_speech_lm, load_speech_lm3) else directory.root)
    size = sum(path.stat().st_size for path in Path(model_dir).rglob("*") if path.is_file())
    return (f"CosyVoice{version}: llm.pt, flow.pt, hift.pt load with every key matching "
            f"({size / 1e9:.2f} GB in the directory)")


def voice_problems(model_dir: str | Path, voices_dir: str | Path | None) -> tuple[int, list[str]]:
    """(voices the engine would load, 'name: problem' for each it would refuse)."""
    from tts_core.voice_files import list_voices

    voices = list_voices(model_dir, voices_dir)
    return len(voices), [f"{voice.name}: {voice.problem}" for voice in voices if voice.problem]
