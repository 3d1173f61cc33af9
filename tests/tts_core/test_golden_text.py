"""The text tokenizer against the official wrapper's ids (cases/tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tts_core.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir / "CosyVoice-BlankEN")


@pytest.fixture(scope="module")
def cases(golden_dir: Path) -> dict:
    return json.loads((golden_dir / "cases" / "tokenizer.json").read_text(encoding="utf-8"))


def test_golden_tokenizer_ids_match_official(tokenizer: TextTokenizer, cases: dict) -> None:
    for text, ids in zip(cases["texts"], cases["ids"], strict=True):
        assert tokenizer.encode(text) == ids, text


def test_golden_tokenizer_decode_skips_special_tokens(tokenizer: TextTokenizer, cases: dict) -> None:
    for ids, decoded in zip(cases["ids"], cases["decoded"], strict=True):
        assert tokenizer.decode(ids) == decoded


def test_golden_special_tokens_are_single_ids_in_official_order(tokenizer: TextTokenizer, cases: dict) -> None:
    specials = cases["special_tokens"]
    names = [specials["eos_token"], *specials["additional_special_tokens"]]
    assert list(tokenizer.special_tokens) == names
    ids = [tokenizer.token_id(n) for n in names[1:]]
    assert all(i is not None for i in ids)
    for name, token_id in zip(names, [tokenizer.eos_id, *ids], strict=True):
        assert tokenizer.encode(f"a{name}b")[1] == token_id
