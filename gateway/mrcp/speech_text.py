"""What a SPEAK body asks to be said: its text, from text/plain or SSML (RFC 6787 §8.7, W3C SSML 1.0).

SSML is reduced to the words it speaks (element text and `<sub alias>`), with a space where an element
such as `<s>`, `<p>` or `<break>` separates words. This stands in for the gateway's SSML module (breaks as
silence, say-as, prosody) until that lands below every adapter; then this module only picks the content
type. Parsed with expat and refused outright when the document declares a DOCTYPE or an entity, so no
entity expansion or external fetch can happen. No sockets, no clocks.
"""

from __future__ import annotations

import xml.parsers.expat

TEXT_TYPES = ("text/plain",)
SSML_TYPES = ("application/ssml+xml", "application/synthesis+ssml")  # the second: MRCPv1 / UniMRCP's umc
URI_LIST = "text/uri-list"


class SpeechTextError(ValueError):
    """The body cannot be read as speech (Completion-Cause 002 parse-failure)."""


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";", 1)[0].strip().lower()


def speech_text(content_type: str, body: bytes) -> str:
    """The text to speak; `content_type` is one of TEXT_TYPES or SSML_TYPES (lower-case, no parameters)."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpeechTextError(f"body is not UTF-8 (byte {exc.start})") from None
    if content_type in TEXT_TYPES:
        return text.strip()
    return _ssml_words(text)


def _ssml_words(document: str) -> str:
    parser = xml.parsers.expat.ParserCreate()
    words: list[str] = []
    skip_depth = 0  # inside <sub alias=...> the alias was said instead of the content
    root: list[str] = []

    def refuse(*_args) -> None:
        raise SpeechTextError("SSML with a DOCTYPE or entity declaration is refused")

    def start(name: str, attributes: dict[str, str]) -> None:
        nonlocal skip_depth
        if not root:
            root.append(name)
        words.append(" ")
        if skip_depth:
            skip_depth += 1
        elif name.rpartition("}")[2] == "sub" and "alias" in attributes:
            words.append(attributes["alias"])
            skip_depth = 1

    def end(_name: str) -> None:
        nonlocal skip_depth
        words.append(" ")
        if skip_depth:
            skip_depth -= 1

    def characters(data: str) -> None:
        if not skip_depth:
            words.append(data)

    parser.StartDoctypeDeclHandler = refuse
    parser.EntityDeclHandler = refuse
    parser.ExternalEntityRefHandler = refuse
    parser.StartElementHandler = start
    parser.EndElementHandler = end
    parser.CharacterDataHandler = characters
    try:
        parser.Parse(document, True)
    except xml.parsers.expat.ExpatError as exc:
        raise SpeechTextError(f"SSML is not well-formed XML: {exc}") from None
    if root[0].rpartition("}")[2] != "speak":
        raise SpeechTextError(f"SSML root element is <{root[0][:40]}>, expected <speak>")
    return " ".join("".join(words).split())
