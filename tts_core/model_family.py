"""Which CosyVoice generation (2 or 3) a model directory holds, read from the directory itself.

The official layout names the yaml after the family (`cosyvoice2.yaml`, `cosyvoice3.yaml`) and the
yaml names the classes it builds. Both must agree: a CosyVoice3 yaml renamed to cosyvoice2.yaml, or
a directory holding both files, is refused with one line naming the disagreement, before any
weights are read. This module never builds a model; it only says which builders apply.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tts_core.model_config import load_model_yaml


class ModelFamilyError(ValueError):
    pass


@dataclass(frozen=True)
class ModelFamily:
    version: int
    yaml_name: str
    speech_tokenizer_name: str
    # The official classes each top-level yaml section must build (`!new:` target, last dotted part).
    classes: tuple[tuple[str, str], ...]

    def require(self, version: int, where: Path | str) -> None:
        if self.version != version:
            raise ModelFamilyError(f"{where}: a CosyVoice{self.version} model directory ({self.yaml_name}); "
                                   f"this loader needs CosyVoice{version}")


FAMILIES: dict[int, ModelFamily] = {
    2: ModelFamily(2, "cosyvoice2.yaml", "speech_tokenizer_v2.onnx",
                   (("llm", "Qwen2LM"), ("flow", "CausalMaskedDiffWithXvec"), ("hift", "HiFTGenerator"))),
    3: ModelFamily(3, "cosyvoice3.yaml", "speech_tokenizer_v3.onnx",
                   (("llm", "CosyVoice3LM"), ("flow", "CausalMaskedDiffWithDiT"), ("hift", "CausalHiFTGenerator"))),
}


@dataclass(frozen=True)
class DetectedFamily:
    family: ModelFamily
    yaml_path: Path
    raw_config: dict[str, Any]


def detect_family(root: Path, expected: int | None = None) -> DetectedFamily:
    """The family of the directory `root`; `expected` refuses the other one."""
    if expected is not None and expected not in FAMILIES:
        raise ModelFamilyError(f"unknown CosyVoice family {expected} (known: {sorted(FAMILIES)})")
    present = [f for f in FAMILIES.values() if (root / f.yaml_name).is_file()]
    if not present:
        names = " or ".join(f.yaml_name for f in FAMILIES.values())
        raise ModelFamilyError(f"{root}: no {names}: not an official CosyVoice model directory")
    if len(present) > 1:
        raise ModelFamilyError(f"{root}: holds both {present[0].yaml_name} and {present[1].yaml_name}; "
                               "keep the one that matches llm.pt/flow.pt/hift.pt")
    family = present[0]
    yaml_path = root / family.yaml_name
    raw = load_model_yaml(yaml_path)
    for section, wanted in family.classes:
        node = raw.get(section)
        built = str(node.get("_new", "")) if isinstance(node, dict) else ""
        if built.rsplit(".", 1)[-1] != wanted:
            raise ModelFamilyError(f"{yaml_path}: `{section}:` builds {built or 'nothing'!s}, expected {wanted} "
                                   f"for a CosyVoice{family.version} directory")
    if expected is not None:
        family.require(expected, root)
    return DetectedFamily(family, yaml_path, raw)
