"""SSML in, plain text out: until an engine speaks SSML, a request in SSML is spoken as its text content.

jambonz marks a request `type: "ssml"` when its text starts with `<speak` (mod_custom_tts does exactly that
test), so the same check decides here. Tags become spaces (a `<break/>` between two words must not glue them
together) and XML character references are decoded. Regex, not an XML parser: nothing here resolves entities
or fetches anything, so a hostile document cannot reach the network or blow up memory (no XXE, no billion
laughs).
"""

from __future__ import annotations

import html
import re

_TAG = re.compile(r"<[^<>]*>")
_SPACES = re.compile(r"[ \t\r\n]+")


def is_ssml(text: str) -> bool:
    return text.lstrip().startswith("<speak")


def ssml_text(document: str) -> str:
    """The words of an SSML document, whitespace collapsed."""
    without_tags = _TAG.sub(" ", document)
    return _SPACES.sub(" ", html.unescape(without_tags)).strip()
