"""Locate and validate a CosyVoice2 or CosyVoice3 model directory in the official layout.

    <dir>/cosyvoice2.yaml           hyper-parameters (read as data, never executed); CosyVoice3
      or cosyvoice3.yaml            directories carry cosyvoice3.yaml instead
    <dir>/CosyVoice-BlankEN/        Qwen2 config.json + tokenizer files (the yaml's qwen_pretrain_path;
                                    empty there means this folder, as the official loader does)
    <dir>/llm.pt, flow.pt, hift.pt  state dicts
    <dir>/spk2info.pt               optional: saved speakers
    <dir>/campplus.onnx, speech_tokenizer_v2.onnx (v3 for CosyVoice3)
                                    optional here: only needed to enrol a new prompt voice

The family (2 or 3) is read from the directory, never configured: the yaml's file name and the
classes it names for llm / flow / hift must agree (`tts_core/model_family.py`). Errors name the
missing file or the disagreeing class in one line. Builders for the model parts live next to each part; this module
only builds the speech LMs (CosyVoice2's and CosyVoice3's), whose sizes all come from the directory itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from tts_core.checkpoint import load_strict, read_state_dict
from tts_core.llm.qwen2 import Qwen2Config
from tts_core.llm.sampling import SamplingConfig
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.llm.speech_lm3 import CosyVoice3LM
from tts_core.model_config import load_model_yaml
from tts_core.model_family import ModelFamily, detect_family
from tts_core.text.cosyvoice3 import ENDOFPROMPT, cosyvoice3_tokenizer

LM = TypeVar("LM", bound=SpeechTokenLM)

QWEN_DIR_NAME = "CosyVoice-BlankEN"


class ModelDirError(FileNotFoundError, ValueError):
    """A required file or folder is missing (a ValueError too: the directory is unusable as given)."""


@dataclass(frozen=True)
class ModelDir:
    root: Path
    family: ModelFamily
    yaml_path: Path
    qwen_dir: Path
    llm_path: Path
    flow_path: Path
    hift_path: Path
    spk2info_path: Path | None
    campplus_path: Path | None
    speech_tokenizer_path: Path | None
    config: dict[str, Any]

    @classmethod
    def open(cls, root: str | Path, family: int | None = None) -> ModelDir:
        """Open and check `root`; `family` (2 or 3), when given, refuses a directory of the other one."""
        root = Path(root)
        if not root.is_dir():
            raise ModelDirError(f"model directory not found: {root}")
        found = detect_family(root, expected=family)
        yaml_path = found.yaml_path
        raw = found.raw_config
        qwen_value = raw.get("qwen_pretrain_path") or ""
        qwen_dir = Path(qwen_value) if qwen_value else root / QWEN_DIR_NAME
        if not qwen_dir.is_absolute() and qwen_value:
            qwen_dir = root / qwen_dir
        if not qwen_dir.is_dir():
            raise ModelDirError(f"Qwen2 directory missing: {qwen_dir} (qwen_pretrain_path in {yaml_path})")
        for name in ("config.json", "vocab.json", "merges.txt"):
            _required(qwen_dir / name)
        # Resolve again with the path filled in, as the official loader overrides it.
        config = load_model_yaml(yaml_path, overrides={"qwen_pretrain_path": str(qwen_dir)})
        return cls(
            root=root,
            family=found.family,
            yaml_path=yaml_path,
            qwen_dir=qwen_dir,
            llm_path=_required(root / "llm.pt"),
            flow_path=_required(root / "flow.pt"),
            hift_path=_required(root / "hift.pt"),
            spk2info_path=_optional(root / "spk2info.pt"),
            campplus_path=_optional(root / "campplus.onnx"),
            speech_tokenizer_path=_optional(root / found.family.speech_tokenizer_name),
            config=config,
        )

    @property
    def llm_section(self) -> dict[str, Any]:
        section = self.config.get("llm")
        if not isinstance(section, dict):
            raise ValueError(f"{self.yaml_path}: no `llm:` section")
        return section

    @property
    def qwen_config(self) -> Qwen2Config:
        return Qwen2Config.from_json(self.qwen_dir / "config.json")

    @property
    def sampling(self) -> SamplingConfig:
        return SamplingConfig.from_yaml(self.llm_section)


def load_speech_lm(model_dir: ModelDir | str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> SpeechTokenLM:
    """Build the CosyVoice2 speech LM from the directory's configs and load `llm.pt` strictly."""
    md = model_dir if isinstance(model_dir, ModelDir) else ModelDir.open(model_dir, family=2)
    md.family.require(2, md.root)
    lm = SpeechTokenLM(md.qwen_config, speech_token_size=_speech_token_size(md),
                       llm_input_size=md.llm_section.get("llm_input_size"),
                       llm_output_size=md.llm_section.get("llm_output_size"))
    return _load_llm_weights(lm, md, device, dtype)


def load_speech_lm3(model_dir: ModelDir | str | Path, device: torch.device | str = "cpu",
                    dtype: torch.dtype = torch.float32) -> CosyVoice3LM:
    """Build the CosyVoice3 speech LM; `<|endofprompt|>`'s id comes from the directory's tokenizer."""
    md = model_dir if isinstance(model_dir, ModelDir) else ModelDir.open(model_dir, family=3)
    md.family.require(3, md.root)
    endofprompt = cosyvoice3_tokenizer(md.qwen_dir).token_id(ENDOFPROMPT)
    if endofprompt is None:
        raise ValueError(f"{md.qwen_dir}: the tokenizer has no {ENDOFPROMPT}")
    lm = CosyVoice3LM(md.qwen_config, speech_token_size=_speech_token_size(md), endofprompt_id=endofprompt,
                      llm_input_size=md.llm_section.get("llm_input_size"),
                      llm_output_size=md.llm_section.get("llm_output_size"))
    return _load_llm_weights(lm, md, device, dtype)


def _speech_token_size(md: ModelDir) -> int:
    try:
        return int(md.llm_section["speech_token_size"])
    except KeyError:
        raise ValueError(f"{md.yaml_path}: llm.speech_token_size is missing") from None


def _load_llm_weights(lm: LM, md: ModelDir, device: torch.device | str, dtype: torch.dtype) -> LM:
    load_strict(lm, read_state_dict(md.llm_path), str(md.llm_path))
    return lm.to(device=device, dtype=dtype).eval()


def _required(path: Path) -> Path:
    if not path.is_file():
        raise ModelDirError(f"model file missing: {path}")
    return path


def _optional(path: Path) -> Path | None:
    return path if path.is_file() else None
