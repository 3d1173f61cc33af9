"""What text an engine may be asked to speak: the one check every request passes before a call is answered.

Text reaches us from SIP headers (decoded with surrogateescape, so raw bytes that are not UTF-8 survive as lone
surrogates), from percent-decoding, from YAML routes and from HTTP bodies. An engine must never be the first to
find out that a string cannot be encoded or holds a NUL: the C libraries behind them (libespeak-ng) cut text at
NUL and raise from deep inside a worker thread on surrogates. So the rule lives here, once, and refusals name
what is wrong so an operator can find the sender.
"""

from __future__ import annotations

import unicodedata

# Whitespace controls a prompt may carry (a YAML block scalar has newlines); every other C0/C1 control is refused.
_ALLOWED_CONTROLS = frozenset("\t\n\r")


def text_problem(text: str) -> str | None:
    """Why `text` cannot be spoken, or None when it can: not UTF-8, control characters, nothing speakable."""
    for index, char in enumerate(text):
        if "\ud800" <= char <= "\udfff":
            return f"text is not valid UTF-8 (undecodable byte at character {index})"
        if char == "\0":
            return f"text holds a NUL character at position {index}"
        if char not in _ALLOWED_CONTROLS and unicodedata.category(char) == "Cc":
            return f"text holds control character U+{ord(char):04X} at position {index}"
    if not any(unicodedata.category(char)[0] in "LN" for char in text):
        return "text has no letters or digits to speak"
    return None
