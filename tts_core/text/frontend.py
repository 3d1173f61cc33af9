"""TextFrontend: a request's text -> normalised segments -> text tokens per segment (the official
`text_normalize(text, split=True)` path, then the Qwen2 tokenizer), remembered for recent texts.

The result is a pure function of the text, and a call center speaks the same prompts all day, so the last
`cache_texts` results are kept: the FST normaliser costs ~10 ms for a 300-character prompt, and that time sits in
front of every first chunk. Thread-safe: engines run it off their event loop, several threads may share it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from tts_core.text.normalize import TextNormalizer, is_only_punctuation
from tts_core.text.tokenizer import TextTokenizer

CACHE_TEXTS = 256  # distinct prompt texts kept; a few KB each


class TextFrontend:
    def __init__(self, tokenizer: TextTokenizer, normalizer: TextNormalizer | None,
                 cache_texts: int = CACHE_TEXTS) -> None:
        """`normalizer` None: texts are already normalised and spoken as one segment (benchmarks)."""
        self.tokenizer = tokenizer
        self.normalizer = normalizer
        self._cache_texts = cache_texts
        self._cache: OrderedDict[str, tuple[tuple[int, ...], ...]] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[list[int]]:
        """The text's tokens per segment; [] when there is nothing to say."""
        segments = self._remembered(text)
        if segments is None:
            segments = self._segments(text)
            with self._lock:
                self._cache[text] = segments
                if len(self._cache) > self._cache_texts:
                    self._cache.popitem(last=False)
        return [list(ids) for ids in segments]  # the caller's own lists: a job may not change the cache

    def knows(self, text: str) -> bool:
        """True when `text` is remembered, so calling the frontend costs a look-up, not a normalisation."""
        return self._remembered(text) is not None

    def _remembered(self, text: str) -> tuple[tuple[int, ...], ...] | None:
        with self._lock:
            segments = self._cache.get(text)
            if segments is not None:
                self._cache.move_to_end(text)
            return segments

    def _segments(self, text: str) -> tuple[tuple[int, ...], ...]:
        if is_only_punctuation("".join(text.split())):  # nothing to say (wetext asserts on it)
            return ()
        pieces = self.normalizer.split(text) if self.normalizer is not None else [text]
        return tuple(tuple(ids) for ids in (self.tokenizer.encode(p) for p in pieces) if ids)
