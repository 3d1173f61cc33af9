"""CosyVoice3's cap on runs of silent / breath speech tokens between the LM and the flow.

The official `llm_job` passes at most `max_run` silent tokens in a row to the flow and drops the
rest of the run until a non-silent token comes; the LM itself still sees every token it drew (its
history is not filtered). This caps long pauses the LM sometimes produces. CosyVoice2 has no such
list. Pure bookkeeping over ints; one object per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

# The official silent-token ids of CosyVoice3's 6561-code speech tokenizer (v3).
COSYVOICE3_SILENT_TOKENS: frozenset[int] = frozenset({1, 2, 28, 29, 55, 248, 494, 2241, 2242, 2322, 2323})
COSYVOICE3_MAX_SILENT_RUN = 5


class SilentRunFilter:
    def __init__(self, silent_tokens: Iterable[int] = COSYVOICE3_SILENT_TOKENS,
                 max_run: int = COSYVOICE3_MAX_SILENT_RUN) -> None:
        self.silent_tokens = frozenset(silent_tokens)
        self.max_run = max_run
        self._run = 0

    def keep(self, token: int) -> bool:
        """Whether the flow gets `token`; call once per token, in order."""
        if token not in self.silent_tokens:
            self._run = 0
            return True
        self._run += 1
        return self._run <= self.max_run

    def filter(self, tokens: Iterable[int]) -> Iterator[int]:
        return (t for t in tokens if self.keep(t))
