"""The model family (2 or 3) is read from the directory; a wrong or incomplete one is refused in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tts_core.model_dir import ModelDir, ModelDirError, load_speech_lm
from tts_core.model_family import ModelFamilyError


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=shutil.copyfile)
    return dst


def test_family_read_from_each_directory(tiny3_model_dir: Path, tiny_model_dir: Path) -> None:
    cv3 = ModelDir.open(tiny3_model_dir)
    assert cv3.family.version == 3
    assert cv3.qwen_dir == tiny3_model_dir / "CosyVoice-BlankEN"
    assert ModelDir.open(tiny_model_dir).family.version == 2


def test_wrong_family_refused_in_one_line(tiny3_model_dir: Path, tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"CosyVoice3 model directory .*needs CosyVoice2") as err:
        ModelDir.open(tiny3_model_dir, family=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs CosyVoice3"):
        ModelDir.open(tiny_model_dir, family=3)
    # The CosyVoice2 speech LM loader refuses a CosyVoice3 directory before reading weights.
    with pytest.raises(ModelFamilyError, match="needs CosyVoice2"):
        load_speech_lm(tiny3_model_dir)


def test_yaml_renamed_to_the_other_family_refused(tiny3_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny3_model_dir, tmp_path / "m")
    (d / "cosyvoice3.yaml").rename(d / "cosyvoice2.yaml")
    with pytest.raises(ValueError, match=r"`llm:` builds cosyvoice\.llm\.llm\.CosyVoice3LM, expected Qwen2LM"):
        ModelDir.open(d)


def test_both_yamls_refused(tiny3_model_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    d = _copy(tiny3_model_dir, tmp_path / "m")
    shutil.copyfile(tiny_model_dir / "cosyvoice2.yaml", d / "cosyvoice2.yaml")
    with pytest.raises(ValueError, match="holds both"):
        ModelDir.open(d)


@pytest.mark.parametrize("missing", ["cosyvoice3.yaml", "flow.pt", "hift.pt", "llm.pt",
                                     "CosyVoice-BlankEN/vocab.json"])
def test_missing_file_named(tiny3_model_dir: Path, tmp_path: Path, missing: str) -> None:
    d = _copy(tiny3_model_dir, tmp_path / "m")
    (d / missing).unlink()
    with pytest.raises(ValueError) as err:
        ModelDir.open(d)
    message = str(err.value)
    assert "\n" not in message
    assert missing.split("/")[-1] in message
    assert isinstance(err.value, (ModelDirError, ModelFamilyError))


def test_each_generation_loader_refuses_the_other(tiny3_model_dir: Path, tiny_model_dir: Path) -> None:
    from tts_core.flow import load_flow
    from tts_core.flow.dit_flow import load_dit_flow
    from tts_core.hift import load_hift
    from tts_core.hift.causal import load_causal_hift
    from tts_core.model_dir import load_speech_lm3

    for load in (load_flow, load_hift):
        with pytest.raises(ModelFamilyError, match="CosyVoice3 model directory .*needs CosyVoice2"):
            load(tiny3_model_dir)
    for load in (load_dit_flow, load_causal_hift, load_speech_lm3):
        with pytest.raises(ModelFamilyError, match="CosyVoice2 model directory .*needs CosyVoice3"):
            load(tiny_model_dir)
