"""The CosyVoice3 tokenizer against the official wrapper's outputs (cases/tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tts_core.text.cosyvoice3 import (
    COSYVOICE3_SPECIAL_TOKENS,
    ENDOFPROMPT,
    INSTRUCT_TEXTS,
    SYSTEM_PREFIX,
    cosyvoice3_tokenizer,
    zero_shot_prompt_text,
)
from tts_core.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def case(golden3_dir: Path) -> dict:
    return json.loads((golden3_dir / "cases" / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def tok(tiny3_model_dir: Path) -> TextTokenizer:
    return cosyvoice3_tokenizer(tiny3_model_dir / "CosyVoice-BlankEN")


def test_special_tokens_in_official_order(case: dict) -> None:
    assert list(COSYVOICE3_SPECIAL_TOKENS) == case["special_tokens"]["additional_special_tokens"]


def test_special_token_ids(tok: TextTokenizer, case: dict) -> None:
    ids = {t: tok.token_id(t) for t in case["special_token_ids"]}
    assert ids == case["special_token_ids"]
    assert tok.token_id(ENDOFPROMPT) == case["endofprompt_id"]
    assert tok.eos_id == case["special_token_ids"][case["special_tokens"]["eos_token"]]
    assert min(ids.values()) >= case["base_vocab_size"]
    # Every id has an embedding row in the LLM's text table.
    assert max(ids.values()) < case["qwen_vocab_size"]


def test_ids_and_decoded_text(tok: TextTokenizer, case: dict) -> None:
    assert len(case["texts"]) == len(case["ids"]) == len(case["decoded"])
    for text, ids, decoded in zip(case["texts"], case["ids"], case["decoded"], strict=True):
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == decoded, text


def test_instruct_texts_and_prefix(tok: TextTokenizer, case: dict) -> None:
    assert list(INSTRUCT_TEXTS) == case["instruct_list"]
    assert [tok.encode(t) for t in INSTRUCT_TEXTS] == case["instruct_list_ids"]
    assert all(t.endswith(ENDOFPROMPT) for t in INSTRUCT_TEXTS)
    assert SYSTEM_PREFIX == case["system_prefix"]


def test_zero_shot_prompt_text_carries_the_prefix_once() -> None:
    assert zero_shot_prompt_text("您好") == SYSTEM_PREFIX + "您好"
    assert zero_shot_prompt_text(SYSTEM_PREFIX + "您好") == SYSTEM_PREFIX + "您好"


def test_the_golden_speaker_prompt_text_is_the_prefixed_transcript(tok: TextTokenizer, tiny3_model_dir: Path) -> None:
    """spk2info's prompt_text: the system prefix then the transcript, encoded by this tokenizer."""
    import torch

    speaker = next(iter(torch.load(tiny3_model_dir / "spk2info.pt", weights_only=False).values()))
    ids = speaker["prompt_text"][0].tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert text.startswith(SYSTEM_PREFIX)
    assert tok.encode(zero_shot_prompt_text(text[len(SYSTEM_PREFIX):])) == ids
