"""TextFrontend: text -> token ids per segment, the same whether computed or remembered, and never changed by
what a job does with its copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from tts_core.text.frontend import TextFrontend
from tts_core.text.normalize import TextNormalizer
from tts_core.text.tokenizer import TextTokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> TextTokenizer:
    return TextTokenizer(tiny_model_dir / "CosyVoice-BlankEN")


def test_segments_are_the_normalised_sentences_tokenised(tokenizer: TextTokenizer) -> None:
    normalizer = TextNormalizer(tokenizer)
    frontend = TextFrontend(tokenizer, normalizer)
    text = "Your balance is 42 dollars. " * 12 + "Goodbye."
    expected = [tokenizer.encode(s) for s in normalizer.split(text)]
    assert len(expected) > 1  # long enough to be split
    assert frontend(text) == expected
    assert frontend("... !") == []  # nothing to say


def test_a_remembered_text_gives_the_same_tokens_and_a_fresh_copy(tokenizer: TextTokenizer) -> None:
    frontend = TextFrontend(tokenizer, TextNormalizer(tokenizer))
    text = "Thank you for calling. Please hold."
    assert not frontend.knows(text)
    first = frontend(text)
    assert frontend.knows(text)
    first[0].append(-1)  # a job's copy is its own
    first.append([1, 2])
    assert frontend(text) == TextFrontend(tokenizer, TextNormalizer(tokenizer))(text)


def test_only_the_most_recent_texts_are_remembered(tokenizer: TextTokenizer) -> None:
    frontend = TextFrontend(tokenizer, None, cache_texts=2)
    frontend("one")
    frontend("two")
    frontend("one")  # used again: now the most recent
    frontend("three")  # evicts "two", the least recently used
    assert [frontend.knows(t) for t in ("one", "two", "three")] == [True, False, True]


def test_a_text_with_a_special_marker_is_spoken_as_written(tiny3_model_dir: Path) -> None:
    """The official frontend skips normalisation and splitting for any text holding `<|...|>`."""
    from tts_core.text.cosyvoice3 import SYSTEM_PREFIX, cosyvoice3_tokenizer

    tok = cosyvoice3_tokenizer(tiny3_model_dir / "CosyVoice-BlankEN")
    text = SYSTEM_PREFIX + "Your balance is 42 dollars. " * 12
    assert len(TextFrontend(tok, TextNormalizer(tok))(text.replace(SYSTEM_PREFIX, ""))) > 1
    assert TextFrontend(tok, TextNormalizer(tok))(text) == [tok.encode(text)]
