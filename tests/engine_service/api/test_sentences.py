"""SentenceSplitter: sentences come out as soon as their end is certain, English and Chinese, and no sooner."""

from __future__ import annotations

import pytest

from engine_service.api.sentences import SentenceSplitter


def feed(pieces: list[str], max_chars: int = 300) -> tuple[list[str], str | None]:
    splitter = SentenceSplitter(max_chars=max_chars)
    out: list[str] = []
    for piece in pieces:
        out += splitter.push(piece)
    return out, splitter.flush()


def test_english_sentence_ends_when_the_space_after_its_period_arrives():
    splitter = SentenceSplitter()
    assert splitter.push("Hello there.") == []  # "." may still become "..." or "3.14"
    assert splitter.push(" How") == ["Hello there."]
    assert splitter.push(" are you?") == []
    assert splitter.flush() == "How are you?"


def test_llm_tokens_split_into_sentences_in_order():
    tokens = ["It", "'s", " sunny", " today", ".", " Take", " a", " hat", "!", " Bye", "."]
    assert feed(tokens) == (["It's sunny today.", "Take a hat!"], "Bye.")


def test_decimals_abbreviations_and_initials_do_not_end_a_sentence():
    sentences, rest = feed(["Pi is 3.14 roughly. Dr. Smith and J. R. Doe met e.g. at noon. Then left"])
    assert sentences == ["Pi is 3.14 roughly.", "Dr. Smith and J. R. Doe met e.g. at noon."]
    assert rest == "Then left"


def test_closing_quotes_stay_with_their_sentence_and_repeated_enders_join():
    sentences, rest = feed(['"Stop!" He ran (fast.) Really?! ', "Yes"])
    assert sentences == ['"Stop!"', "He ran (fast.)", "Really?!"]
    assert rest == "Yes"


def test_chinese_enders_cut_at_once_without_a_following_space():
    splitter = SentenceSplitter()
    assert splitter.push("你好。") == ["你好。"]
    assert splitter.push("今天天气很好！明天呢？") == ["今天天气很好！", "明天呢？"]
    assert splitter.push("我们走吧") == []
    assert splitter.flush() == "我们走吧"


def test_chinese_closing_quote_and_ellipsis_stay_with_the_sentence():
    assert feed(["他说：“好的。”然后走了……", "再见"]) == (["他说：“好的。”", "然后走了……"], "再见")


def test_newline_ends_a_line_of_text():
    assert feed(["first line\nsecond line"]) == (["first line"], "second line")


def test_run_on_text_is_cut_at_a_clause_mark_before_max_chars():
    text = "one two three, four five six seven eight nine ten eleven"
    sentences, rest = feed([text], max_chars=30)
    assert sentences[0] == "one two three,"
    assert all(len(s) <= 30 for s in sentences)
    assert " ".join(sentences + [rest]) == text


def test_flush_of_nothing_and_clear():
    splitter = SentenceSplitter()
    assert splitter.flush() is None
    splitter.push("unfinished")
    splitter.clear()
    assert splitter.flush() is None


def test_max_chars_must_leave_room_for_a_sentence():
    with pytest.raises(ValueError):
        SentenceSplitter(max_chars=3)
