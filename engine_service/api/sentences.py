"""SentenceSplitter: cut text that arrives in pieces (an LLM's tokens) into sentences to speak one by one.

A sentence is spoken as soon as its end is certain, so the first audio of a reply does not wait for the whole
reply. Chinese and other full-width enders (。！？；…) end a sentence at once. Latin enders (. ! ? ;) end one
only when whitespace follows, because "3." may become "3.14" and "e.g." is no end at all; a short list of
abbreviations ("Mr.", "e.g.") never ends one. Closing quotes and brackets after an ender stay with its sentence.
A sentence that grows past `max_chars` without an ender is cut at its last clause mark (, ， 、 ：) or space, so
a run-on stream still speaks in bounded pieces. `flush()` hands out whatever is left (the bot said "flush").

Pure: no I/O, no clocks, no engine; the WebSocket handlers own when to push and flush.
"""

from __future__ import annotations

import re

_IMMEDIATE_ENDERS = "。！？；…\n"  # full-width enders need no following space; a newline ends a line of text
_LATIN_ENDERS = ".!?;"
_CLOSERS = "\"')]}”’」』）】》"
_CLAUSE_MARKS = ",，、：:"
_ABBREVIATIONS = frozenset({
    "mr.", "mrs.", "ms.", "dr.", "prof.", "sr.", "jr.", "st.", "vs.", "etc.", "e.g.", "i.e.", "no.", "fig.",
    "approx.", "dept.", "inc.", "ltd.", "co.", "mt.", "a.m.", "p.m.", "u.s.",
})
_LAST_WORD = re.compile(r"(\S+)$")


class SentenceSplitter:
    def __init__(self, max_chars: int = 300) -> None:
        if max_chars < 10:
            raise ValueError("max_chars must be at least 10")
        self._max_chars = max_chars
        self._pending = ""

    @property
    def pending(self) -> str:
        return self._pending

    def push(self, text: str) -> list[str]:
        """Add text; return the sentences it completed, in order (stripped, never empty)."""
        self._pending += text
        sentences: list[str] = []
        while (cut := self._next_cut()) is not None:
            sentence, self._pending = self._pending[:cut].strip(), self._pending[cut:]
            if sentence:
                sentences.append(sentence)
        return sentences

    def flush(self) -> str | None:
        """Whatever is left, as one sentence (None when nothing speakable is pending)."""
        sentence, self._pending = self._pending.strip(), ""
        return sentence or None

    def clear(self) -> None:
        self._pending = ""

    def _next_cut(self) -> int | None:
        """Index just past the first certain sentence end in the pending text, or None."""
        text = self._pending
        for i, char in enumerate(text):
            if char in _IMMEDIATE_ENDERS:
                return _past_closers(text, i + 1)
            if char in _LATIN_ENDERS:
                end = _past_closers(text, i + 1)
                if end < len(text) and text[end].isspace() and not _is_abbreviation(text[: i + 1]):
                    return end
            if i + 1 >= self._max_chars:
                return _soft_cut(text[: i + 1])
        return None


def _past_closers(text: str, index: int) -> int:
    while index < len(text) and (text[index] in _CLOSERS or text[index] in _IMMEDIATE_ENDERS[:-1]):
        index += 1
    return index


def _is_abbreviation(head: str) -> bool:
    match = _LAST_WORD.search(head)
    if match is None:
        return False
    word = match.group(1).lower().lstrip(_CLOSERS + "(")
    return word in _ABBREVIATIONS or bool(re.fullmatch(r"[a-z]\.", word))  # an initial: "J. Smith"


def _soft_cut(head: str) -> int:
    """Where to cut an over-long sentence: after its last clause mark, else its last space, else here."""
    for marks in (_CLAUSE_MARKS, " "):
        index = max(head.rfind(mark) for mark in marks)
        if index > 0:
            return index + 1
    return len(head)
