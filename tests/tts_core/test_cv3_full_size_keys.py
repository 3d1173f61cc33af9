"""At the real sizes (full/: the official yaml, Qwen2-0.5B config, every official key with its shape),
our CosyVoice3 modules have exactly the official state-dict keys and shapes, so a released checkpoint
loads strictly. Built on the meta device where the weights would be large (nothing is allocated)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tts_core.flow.dit_flow import DiTFlowModel, dit_flow_config_from
from tts_core.hift.causal import CausalHiftGenerator, _conv_pre_look_right
from tts_core.hift.config import hift_config_from
from tts_core.llm.qwen2 import Qwen2Config
from tts_core.llm.speech_lm3 import CosyVoice3LM
from tts_core.model_config import load_model_yaml


@pytest.fixture(scope="module")
def full(golden3_dir: Path) -> Path:
    return golden3_dir / "full"


@pytest.fixture(scope="module")
def official(full: Path) -> dict[str, dict[str, list[int]]]:
    return json.loads((full / "full_keys.json").read_text())


@pytest.fixture(scope="module")
def yaml_cfg(full: Path) -> dict:
    return load_model_yaml(full / "cosyvoice3_full.yaml")


def _shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    return {k: list(v.shape) for k, v in module.state_dict().items()}


def _meta_state(keys: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {k: torch.empty(shape, device="meta") for k, shape in keys.items()}


def test_llm_keys(full: Path, official: dict, yaml_cfg: dict) -> None:
    llm = yaml_cfg["llm"]
    with torch.device("meta"):
        lm = CosyVoice3LM(Qwen2Config.from_json(full / "CosyVoice-BlankEN" / "config.json"),
                          int(llm["speech_token_size"]), endofprompt_id=0,
                          llm_input_size=yaml_cfg["llm_input_size"], llm_output_size=yaml_cfg["llm_output_size"])
    assert _shapes(lm) == official["llm"]


def test_flow_keys(official: dict, yaml_cfg: dict) -> None:
    cfg = dit_flow_config_from(yaml_cfg, _meta_state(official["flow"]))
    with torch.device("meta"):
        flow = DiTFlowModel(cfg)
    assert _shapes(flow) == official["flow"]


def test_hift_keys(official: dict, yaml_cfg: dict) -> None:
    state = _meta_state(official["hift"])
    hift = CausalHiftGenerator(hift_config_from(yaml_cfg, state), _conv_pre_look_right(yaml_cfg))
    assert _shapes(hift) == official["hift"]
