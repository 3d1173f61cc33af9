"""Fixtures shared by the tts_core tests: the tiny golden models' flows, their flow golden cases and
their speakers (CosyVoice2's, and CosyVoice3's with a 3; module scope each, so a test module never
sees another's state)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.flow import FlowModel, load_flow
from tts_core.flow.dit_flow import DiTFlowModel, load_dit_flow


@pytest.fixture(scope="module")
def flow(tiny_model_dir: Path) -> FlowModel:
    torch.set_num_threads(1)
    return load_flow(tiny_model_dir, "cpu", torch.float32)


@pytest.fixture(scope="module")
def flow_case(golden_dir: Path) -> dict:
    return torch.load(golden_dir / "cases" / "flow.pt", weights_only=False)


@pytest.fixture(scope="module")
def speaker(tiny_model_dir: Path) -> dict:
    return next(iter(torch.load(tiny_model_dir / "spk2info.pt", weights_only=False).values()))


@pytest.fixture(scope="module")
def official_call(flow: FlowModel, speaker: dict):
    """`official_call(tokens, finalize)`: the official streaming flow call (full re-run of prompt +
    tokens, chunk-causal masks) for the tiny speaker -> mel (1, 80, frames after the prompt)."""
    pt, pf = speaker["flow_prompt_speech_token"], speaker["prompt_speech_feat"]

    def call(tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        mel, _ = flow.inference(tokens, torch.tensor([tokens.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                                torch.tensor([pf.size(1)]), speaker["flow_embedding"], streaming=True,
                                finalize=finalize)
        return mel

    return call


@pytest.fixture(scope="module")
def flow3(tiny3_model_dir: Path) -> DiTFlowModel:
    torch.set_num_threads(1)
    return load_dit_flow(tiny3_model_dir)


@pytest.fixture(scope="module")
def flow3_case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "flow.pt", weights_only=False)


@pytest.fixture(scope="module")
def speaker3(tiny3_model_dir: Path) -> dict:
    return next(iter(torch.load(tiny3_model_dir / "spk2info.pt", weights_only=False).values()))
