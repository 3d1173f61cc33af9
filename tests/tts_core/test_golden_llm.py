"""The speech LM against the official Qwen2LM's outputs (cases/llm.pt) on the tiny random model.

Tolerances: everything runs in float32 on CPU. Our kernels (SDPA with an explicit mask, our
matmul shapes for the static cache) sum in a different order than transformers' Qwen2, so each
value carries a few float32 ulps of noise (~1e-6 here after log_softmax over ~6.5k outputs). 1e-4
leaves room for deeper or wider golden sets made the same way, while any real defect (rotary layout,
mask, an off-by-one position, a wrong norm eps) moves log-probs by 1e-2 or more.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tts_core.checkpoint import CheckpointMismatch
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.model_dir import ModelDir, ModelDirError, load_speech_lm

LOGP_TOL = 1e-4


@pytest.fixture(scope="module")
def case(golden_dir: Path) -> dict:
    return torch.load(golden_dir / "cases" / "llm.pt", weights_only=False)


@pytest.fixture(scope="module")
def lm(tiny_model_dir: Path) -> SpeechTokenLM:
    torch.set_num_threads(1)
    return load_speech_lm(tiny_model_dir)


@pytest.fixture(scope="module")
def lm_input(lm: SpeechTokenLM, case: dict) -> torch.Tensor:
    return lm.build_prefill_input(case["text_token"], case["prompt_text_token"], case["prompt_speech_token"])


def test_golden_special_ids_and_lengths(lm: SpeechTokenLM, case: dict) -> None:
    assert lm.speech_token_size == case["speech_token_size"]
    assert lm.eos_token == case["eos_token"]
    assert lm.llm_decoder.out_features == case["logp_full"].shape[1]
    assert lm.length_bounds(case["text_token"].numel()) == (case["min_len"], case["max_len"])


def test_golden_lm_input(lm_input: torch.Tensor, case: dict) -> None:
    expected = case["lm_input"][0]
    assert lm_input.shape == expected.shape
    assert (lm_input - expected).abs().max().item() <= 1e-5


def test_golden_logp_full_one_causal_forward(lm: SpeechTokenLM, lm_input: torch.Tensor, case: dict) -> None:
    forced = lm.speech_embedding(case["forced_tokens"].long()).detach()
    logp = lm.teacher_forced_logp(torch.cat([lm_input, forced]))
    assert logp.shape == case["logp_full"].shape
    assert (logp - case["logp_full"]).abs().max().item() <= LOGP_TOL


def test_golden_logp_steps_prefill_then_decode(lm: SpeechTokenLM, lm_input: torch.Tensor, case: dict) -> None:
    expected = case["logp_steps"]
    lm.setup_cache(max_batch=1, max_len=lm_input.shape[0] + expected.shape[0])
    rows = [lm.prefill([0], [lm_input])[0]]
    for token in case["forced_tokens"].tolist():
        rows.append(lm.decode_step([0], [token])[0])
    assert (torch.stack(rows) - expected).abs().max().item() <= LOGP_TOL


def test_golden_batched_slots_at_different_lengths(lm: SpeechTokenLM, lm_input: torch.Tensor,
                                                   case: dict) -> None:
    """Two requests share every step while sitting at different positions of non-adjacent slots."""
    expected, forced = case["logp_steps"], case["forced_tokens"].tolist()
    shift = 3
    lm.setup_cache(max_batch=3, max_len=lm_input.shape[0] + expected.shape[0] + 4)
    ahead = torch.cat([lm_input, lm.speech_embedding(torch.tensor(forced[:shift]))])
    # One padded prefill: slot 2 gets the plain input, slot 0 the input plus `shift` forced tokens.
    first = lm.prefill([2, 0], [lm_input, ahead])
    assert (first[0] - expected[0]).abs().max().item() <= LOGP_TOL
    assert (first[1] - expected[shift]).abs().max().item() <= LOGP_TOL
    for i in range(len(forced) - shift):
        logp = lm.decode_step([2, 0], [forced[i], forced[i + shift]])
        assert (logp[0] - expected[i + 1]).abs().max().item() <= LOGP_TOL, i
        assert (logp[1] - expected[i + 1 + shift]).abs().max().item() <= LOGP_TOL, i


def _linked_model_dir(src: Path, dst: Path, skip: set[str] = frozenset()) -> Path:
    dst.mkdir()
    for entry in src.iterdir():
        if entry.name not in skip:
            os.symlink(entry, dst / entry.name)
    return dst


def test_strict_load_names_a_missing_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _linked_model_dir(tiny_model_dir, tmp_path / "m", skip={"llm.pt"})
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    del state["llm.model.model.layers.1.mlp.up_proj.weight"]
    torch.save(state, model_dir / "llm.pt")
    with pytest.raises(CheckpointMismatch, match=r"missing keys: llm\.model\.model\.layers\.1\.mlp\.up_proj\.weight"):
        load_speech_lm(model_dir)


def test_strict_load_names_a_misshapen_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _linked_model_dir(tiny_model_dir, tmp_path / "m", skip={"llm.pt"})
    state = torch.load(tiny_model_dir / "llm.pt", weights_only=True)
    state["llm_decoder.bias"] = state["llm_decoder.bias"][:-1]
    torch.save(state, model_dir / "llm.pt")
    with pytest.raises(CheckpointMismatch, match=r"misshapen keys: llm_decoder\.bias"):
        load_speech_lm(model_dir)


def test_model_dir_names_the_missing_file(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _linked_model_dir(tiny_model_dir, tmp_path / "m", skip={"flow.pt"})
    with pytest.raises(ModelDirError, match="flow.pt"):
        ModelDir.open(model_dir)


def test_model_dir_fills_empty_qwen_path(tiny_model_dir: Path) -> None:
    md = ModelDir.open(tiny_model_dir)
    assert md.qwen_dir == tiny_model_dir / "CosyVoice-BlankEN"
    assert md.config["qwen_pretrain_path"] == str(md.qwen_dir)
    assert md.sampling.top_k == md.llm_section["sampling"]["top_k"]


def test_golden_full_size_keys_and_shapes(golden_dir: Path) -> None:
    """At the real Qwen2-0.5B size (built without memory on the meta device) every key and shape of
    the official llm.pt is what our module expects, from config.json and the yaml alone."""
    import json

    from tts_core.llm.qwen2 import Qwen2Config
    from tts_core.model_config import load_model_yaml

    full = golden_dir / "full"
    expected = {k: tuple(v) for k, v in json.loads((full / "full_keys.json").read_text())["llm"].items()}
    section = load_model_yaml(full / "cosyvoice2_full.yaml")["llm"]
    with torch.device("meta"):
        lm = SpeechTokenLM(Qwen2Config.from_json(full / "CosyVoice-BlankEN" / "config.json"),
                           speech_token_size=section["speech_token_size"],
                           llm_input_size=section["llm_input_size"], llm_output_size=section["llm_output_size"])
    assert {k: tuple(v.shape) for k, v in lm.state_dict().items()} == expected
