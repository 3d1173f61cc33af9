"""The text tokenizer against the official wrapper's ids (cases/tokenizer.json), and the
normalisation / sentence splitting rules of the official frontend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tts_core.text.normalize import SplitLimits, TextNormalizer, split_paragraph
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


# ---- normalisation and splitting (official text_normalize rules; no golden file for these) ----


@pytest.fixture(scope="module")
def normalizer(tokenizer: TextTokenizer) -> TextNormalizer:
    return TextNormalizer(tokenizer)


def test_mixed_chinese_english_numbers_are_spoken(normalizer: TextNormalizer) -> None:
    assert normalizer.split("您的余额是42.17元, please hold.") == ["您的余额是四十二点一七元, please hold。"]


def test_chinese_percent_phone_and_date(normalizer: TextNormalizer) -> None:
    (segment,) = normalizer.split("请拨打13812345678，增长了15%，时间是2024年3月5日")
    assert "百分之十五" in segment and "二零二四年三月五日" in segment and "三八" in segment
    assert not any(c.isdigit() for c in segment)
    assert segment.endswith("。")  # trailing words are kept, closed with a full stop


def test_english_numbers_are_spelled(normalizer: TextNormalizer) -> None:
    segments = normalizer.split("Order 7781 ships today! Your balance is $42.17, up 15%. Call 555 1234")
    text = " ".join(segments)
    assert "seven thousand seven hundred and eighty one" in text
    assert "forty two point one seven dollars" in text and "fifteen percent" in text
    assert not any(c.isdigit() for c in text)
    assert text.endswith(".")


def test_markup_and_empty_text_pass_through(normalizer: TextNormalizer) -> None:
    assert normalizer.split("<|im_start|>12") == ["<|im_start|>12"]
    assert normalizer.split("") == [""]
    assert normalizer.split("[breath]请稍等<strong>一下</strong>。") == ["[breath]请稍等<strong>一下</strong>。"]


def test_punctuation_only_segments_are_dropped(normalizer: TextNormalizer) -> None:
    assert normalizer.split("。。！") == []


def test_closing_quote_stays_with_its_sentence() -> None:
    limits = SplitLimits(token_max_n=4, token_min_n=2, merge_len=1)
    assert split_paragraph("他说：“你好。”然后走了", len, "zh", limits) == ["他说：", "“你好。”", "然后走了。"]


def _check_packing(segments: list[str], length, limits: SplitLimits, sentence_len: int) -> None:
    # A segment is cut only once it is past token_min_n, and then before a sentence that would take
    # it past token_max_n; so it overshoots token_max_n only by its last sentence, from <= token_min_n.
    for segment in segments[:-1]:
        assert limits.token_min_n < length(segment) <= max(limits.token_max_n, limits.token_min_n + sentence_len)
    assert length(segments[-1]) >= limits.merge_len or len(segments) == 1
    assert length(segments[-1]) <= limits.token_max_n + limits.merge_len + sentence_len


def test_chinese_split_respects_character_bounds(normalizer: TextNormalizer) -> None:
    text = "今天天气很好。" * 30
    segments = normalizer.split(text)
    assert "".join(segments) == text and len(segments) > 1
    _check_packing(segments, len, SplitLimits(), len("今天天气很好。"))


def test_english_split_respects_token_bounds(normalizer: TextNormalizer, tokenizer: TextTokenizer) -> None:
    sentence = "This is sentence number twelve of the test. "
    segments = normalizer.split(sentence * 25)
    assert len(segments) > 1
    assert "".join(segments).split() == (sentence * 25).split()

    def tokens(s: str) -> int:
        return len(tokenizer.encode(s))

    _check_packing(segments, tokens, SplitLimits(), tokens(sentence))


def test_short_tail_merges_into_previous_segment() -> None:
    limits = SplitLimits(token_max_n=10, token_min_n=5, merge_len=3)
    assert split_paragraph("一二三四五六。七八九十一二。好。", len, "zh", limits) == ["一二三四五六。", "七八九十一二。好。"]


def test_digits_of_other_scripts_are_spoken(normalizer: TextNormalizer) -> None:
    assert normalizer.split("Pay ١٢ now") == ["Pay twelve now."]
