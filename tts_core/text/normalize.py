"""Text normalisation and sentence splitting, as the official CosyVoice2 frontend does it.

What we do (the official `text_normalize(text, split=True)` on its `wetext` path; ttsfrd, the
official first choice, is a closed binary we do not use):

1. Texts holding `<|...|>` markup, and empty texts, pass through untouched (one segment).
2. Texts with any CJK ideograph (U+4E00..U+9FFF) take the Chinese path, all others the English path.
3. Written-form to spoken-form conversion with WeTextProcessing's FSTs (`wetext` on PyPI: the FSTs
   ship inside the wheel, so it runs offline): numbers, decimals, percentages, dates, times,
   currency, phone-style digit strings... ("42.17元" -> "四十二点一七元", "15%" -> "fifteen percent").
4. Chinese path: drop newlines; drop blanks unless both neighbours are ASCII; "²"/"³" -> 平方/立方;
   "." -> "。"; " - " -> "，"; remove （）【】` and turn "——" into a blank; a trailing run of
   "，", "," or "、" becomes "。".
   English path: any digit run wetext left is spelled with `inflect` ("7781" -> "seven thousand,
   seven hundred and eighty-one").
5. Split into sentences at sentence punctuation (zh: 。？！；：、.?!; and en: .?!;:), keeping a
   closing quote with its sentence; a text not ending in one gets "。" / "." appended first, so
   no trailing words are lost (an older official version dropped them). Sentences are
   then packed greedily: a new segment starts once adding the next sentence would pass
   `token_max_n` and the current one is already over `token_min_n`; a last segment shorter than
   `merge_len` joins the one before. Lengths are characters for Chinese and text-token counts for
   English (as official: 80 / 60 / 20).
6. Segments made only of punctuation/symbols are dropped.

This module never touches the model: it only needs the text tokenizer to count English tokens.
"""

from __future__ import annotations

import importlib.util
import re
import threading
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass

from tts_core.text.tokenizer import TextTokenizer

_CJK = re.compile(r"[\u4e00-\u9fff]")
_TRAILING_COMMAS = re.compile(r"[，,、]+$")
_ZH_STOPS = frozenset("。？！；：、.?!;")
_EN_STOPS = frozenset(".?!;:")
_COMMAS = frozenset("，,")
_CLOSING_QUOTES = frozenset('"”')


@dataclass(frozen=True)
class SplitLimits:
    token_max_n: int = 80
    token_min_n: int = 60
    merge_len: int = 20
    comma_split: bool = False


def contains_chinese(text: str) -> bool:
    return _CJK.search(text) is not None


def is_only_punctuation(text: str) -> bool:
    """True for text made only of Unicode punctuation (P*) and symbols (S*), or empty."""
    return all(unicodedata.category(c)[0] in "PS" for c in text)


def split_paragraph(text: str, length: Callable[[str], int], lang: str,
                    limits: SplitLimits = SplitLimits()) -> list[str]:
    """Sentences of `text` packed into segments; `length` measures a segment (chars or tokens)."""
    stops = set(_ZH_STOPS if lang == "zh" else _EN_STOPS)
    if limits.comma_split:
        stops |= _COMMAS
    if text and text[-1] not in stops:
        text += "。" if lang == "zh" else "."
    sentences: list[str] = []
    start = 0
    for i, c in enumerate(text):
        if c not in stops:
            continue
        if i > start:
            sentences.append(text[start:i + 1])
        # A closing quote right after the stop belongs to this sentence. (Official quirk kept: a
        # stop with nothing before it still lends the quote to the previous sentence.)
        if i + 1 < len(text) and text[i + 1] in _CLOSING_QUOTES and sentences:
            sentences[-1] += text[i + 1]
            start = i + 2
        else:
            start = i + 1

    segments: list[str] = []
    current = ""
    for sentence in sentences:
        if length(current + sentence) > limits.token_max_n and length(current) > limits.token_min_n:
            segments.append(current)
            current = ""
        current += sentence
    if current:
        if segments and length(current) < limits.merge_len:
            segments[-1] += current
        else:
            segments.append(current)
    return segments


def _drop_blanks_between_non_ascii(text: str) -> str:
    # A blank survives only between two ASCII non-blank characters ("hold on" yes, "你 好" no).
    kept = []
    for i, c in enumerate(text):
        if c == " ":
            before = text[i - 1] if i > 0 else ""
            after = text[i + 1] if i + 1 < len(text) else ""
            if not (before.isascii() and before not in ("", " ") and after.isascii() and after not in ("", " ")):
                continue
        kept.append(c)
    return "".join(kept)


def _zh_cleanup(text: str) -> str:
    text = text.replace("\n", "")
    text = _drop_blanks_between_non_ascii(text)
    text = text.replace("²", "平方").replace("³", "立方")
    text = text.replace(".", "。").replace(" - ", "，")
    for mark in ("（", "）", "【", "】", "`"):
        text = text.replace(mark, "")
    text = text.replace("——", " ")
    return _TRAILING_COMMAS.sub("。", text)


def _spell_digit_runs(text: str, number_to_words: Callable[[str], str]) -> str:
    return re.sub(r"\d+", lambda m: number_to_words(m.group(0)), text)


class TextNormalizer:
    """Turns one request's text into the normalised segments the LM is run on, one at a time.

    Safe to share between threads (the FST normaliser is guarded by a lock)."""

    def __init__(self, tokenizer: TextTokenizer, limits: SplitLimits = SplitLimits()) -> None:
        try:
            from wetext import Normalizer
        except ImportError as missing:  # pragma: no cover - depends on the host
            raise ImportError(f"text normalisation needs the `wetext` package: {missing}") from None
        if importlib.util.find_spec("inflect") is None:  # imported lazily: it takes seconds
            raise ImportError("text normalisation needs the `inflect` package")
        self._tokenizer = tokenizer
        self._limits = limits
        # One configuration serves both languages: the official zh and en normalisers differ only
        # in remove_erhua, which is False for both, and wetext picks its FSTs per text.
        self._fst = Normalizer(remove_erhua=False)
        self._inflect = None
        self._lock = threading.Lock()

    def normalize(self, text: str) -> str:
        """The whole text in spoken form (official `text_normalize(text, split=False)`)."""
        return self._normalize(text)[0]

    def split(self, text: str) -> list[str]:
        """Normalised segments to synthesise in order (official `text_normalize(text, split=True)`)."""
        return self._normalize(text)[1]

    def _number_to_words(self, digits: str) -> str:
        # wetext spells almost every number already; inflect (slow to import) is the rare fallback.
        if self._inflect is None:
            import inflect

            self._inflect = inflect.engine()
        return self._inflect.number_to_words(digits)

    def _normalize(self, text: str) -> tuple[str, list[str]]:
        if text == "" or ("<|" in text and "|>" in text):
            return text, [text]
        text = text.strip()
        with self._lock:
            spoken = self._fst.normalize(text)
        if contains_chinese(text):
            spoken = _zh_cleanup(spoken)
            segments = split_paragraph(spoken, len, "zh", self._limits)
        else:
            if any(c.isdigit() for c in spoken):
                with self._lock:
                    spoken = _spell_digit_runs(spoken, self._number_to_words)
            segments = split_paragraph(spoken, lambda s: len(self._tokenizer.encode(s)), "en", self._limits)
        return spoken, [s for s in segments if not is_only_punctuation(s)]
