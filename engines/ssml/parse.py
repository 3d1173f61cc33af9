"""The SSML subset we speak: a document in, `Speech`/`Pause` segments out (engines/ssml/segments.py).

Tags: `speak`, `break time=|strength=`, `say-as interpret-as=` (engines/ssml/say_as.py), `prosody rate= volume=`,
`sub alias=`, `phoneme` (its text is spoken: CosyVoice2's frontend takes BPE text, not pinyin or IPA), `audio
src=` (a configured prompt, through an `AudioResolver`; its content when the name is unknown), `p`/`s` (a short
pause after), `lang`/`voice`/`emphasis`/`mark` and any unknown tag: their text content. The language of a say-as
reading is the nearest `xml:lang` ("zh*" is Mandarin, anything else English), else that of the last letter
spoken before it, else Mandarin when the document has CJK characters. A document that is not well-formed XML, has no `<speak>` root, or holds a value we cannot
read is refused with `SsmlError` naming the problem; the adapters turn that into a SIP 400 or an HTTP 400.

Parsing is defusedxml's: a DOCTYPE, entity declarations and external references are refused, so a billion-laughs
or XXE document is an error, never expanded. No I/O, no clocks.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from xml.etree.ElementTree import Element, ParseError

import defusedxml.ElementTree as safe_xml
from defusedxml import DefusedXmlException

from engines.ssml.say_as import SayAsError, say_as
from engines.ssml.segments import MAX_PAUSE_MS, Pause, Segment, Speech, merged

MAX_DOCUMENT_CHARS = 20_000

# strength -> ms, as the SSML 1.1 spec orders them (§3.2.3); values close to Polly's and Azure's.
BREAK_STRENGTH_MS = {"none": 0, "x-weak": 100, "weak": 250, "medium": 500, "strong": 750, "x-strong": 1000}
RATE_WORDS = {"x-slow": 0.5, "slow": 0.75, "medium": 1.0, "default": 1.0, "fast": 1.25, "x-fast": 1.5}
VOLUME_WORDS_DB = {"silent": -96.0, "x-soft": -12.0, "soft": -6.0, "medium": 0.0, "default": 0.0, "loud": 6.0,
                   "x-loud": 12.0}
RATE_RANGE = (0.5, 2.0)
VOLUME_RANGE_DB = (-96.0, 12.0)
PARAGRAPH_PAUSE_MS = 300  # after </p>, as a reader would breathe; </s> gets a third of it

_XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
_CJK = re.compile(r"[\u3400-\u9fff]")
_SPACES = re.compile(r"\s+")

AudioResolver = Callable[[str], "Sequence[Segment] | None"]
"""`<audio src=NAME>` -> the named prompt's segments (text of a configured prompt; a prompt cache may plug
in here), or None when NAME is no prompt we know."""


class SsmlError(ValueError):
    """The document cannot be spoken as written; the message names why (shown to the sender)."""


def is_ssml(text: str) -> bool:
    """jambonz's rule (mod_custom_tts sends type ssml when the text starts with `<speak`), ours too."""
    return text.lstrip().startswith("<speak")


@dataclass(frozen=True)
class _Prosody:
    rate: float = 1.0
    volume_db: float = 0.0
    lang: str = "en"
    lang_given: bool = False  # by an xml:lang; else a say-as reads in the language of the words before it


def parse_ssml(document: str, audio: AudioResolver | None = None) -> tuple[Segment, ...]:
    """The segments of `document`; raises SsmlError."""
    if len(document) > MAX_DOCUMENT_CHARS:
        raise SsmlError(f"SSML document has {len(document)} characters, limit is {MAX_DOCUMENT_CHARS}")
    try:
        root = safe_xml.fromstring(document.strip(), forbid_dtd=True)
    except ParseError as exc:
        raise SsmlError(f"SSML is not well-formed XML: {exc}") from None
    except DefusedXmlException as exc:  # DTDs, entities, external references: never expanded
        raise SsmlError(f"SSML refused: {type(exc).__name__} (no DOCTYPE or entities allowed)") from None
    if _local(root.tag) != "speak":
        raise SsmlError(f"SSML root element must be <speak>, got <{_local(root.tag)}>")
    given = root.get(_XML_LANG)
    lang = given or ("zh" if _CJK.search(document) else "en")
    out: list[Segment] = []
    _walk(root, _Prosody(lang=_language(lang), lang_given=given is not None), out, audio)
    return merged(out)


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1].lower()  # namespaced SSML (xmlns="http://www.w3.org/2001/10/synthesis")


def _language(code: str) -> str:
    return "zh" if code.lower().startswith(("zh", "cmn", "yue")) else "en"


def _text(text: str | None, prosody: _Prosody) -> Speech | None:
    if not text:
        return None
    return Speech(_SPACES.sub(" ", text), prosody.rate, prosody.volume_db)  # a lone space still parts two words


def _walk(element: Element, prosody: _Prosody, out: list[Segment], audio: AudioResolver | None) -> None:
    tag = _local(element.tag)
    if lang := element.get(_XML_LANG):
        prosody = replace(prosody, lang=_language(lang), lang_given=True)
    if tag == "break":
        out.append(Pause(_break_ms(element)))
    elif tag == "say-as":
        content = "".join(element.itertext())
        kind = element.get("interpret-as")
        if kind is None:
            raise SsmlError("<say-as> needs interpret-as")
        try:
            words = say_as(content, kind, _reading_language(prosody, out), element.get("format"))
        except SayAsError as exc:
            raise SsmlError(str(exc)) from None
        out.append(Speech(words if words is not None else _SPACES.sub(" ", content), prosody.rate,
                          prosody.volume_db))
    elif tag == "sub":
        alias = element.get("alias")
        if alias is None:
            raise SsmlError("<sub> needs alias")
        out.append(Speech(alias, prosody.rate, prosody.volume_db))
    elif tag == "audio":
        _audio(element, prosody, out, audio)
    else:
        if tag == "prosody":
            prosody = replace(prosody, rate=_rate(element.get("rate"), prosody.rate),
                              volume_db=_volume(element.get("volume"), prosody.volume_db))
        _content(element, prosody, out, audio)
        if tag in ("p", "s"):
            out.append(Pause(PARAGRAPH_PAUSE_MS if tag == "p" else PARAGRAPH_PAUSE_MS // 3))
    # the tails of break, say-as, sub and audio are read by the parent's _content


def _content(element: Element, prosody: _Prosody, out: list[Segment], audio: AudioResolver | None) -> None:
    """An element's text and children, in document order (a child's tail is the text after it)."""
    if (speech := _text(element.text, prosody)) is not None:
        out.append(speech)
    for child in element:
        _walk(child, prosody, out, audio)
        if (speech := _text(child.tail, prosody)) is not None:
            out.append(speech)


def _reading_language(prosody: _Prosody, before: list[Segment]) -> str:
    """The language a say-as is read in: its xml:lang; else that of the last letter spoken before it
    ("Balance 12" in a Mandarin document is English); else the document's."""
    if not prosody.lang_given:
        for segment in reversed(before):
            if isinstance(segment, Speech):
                letters = [c for c in segment.text if c.isalpha()]
                if letters:
                    return "zh" if _CJK.match(letters[-1]) else "en"
    return prosody.lang


def _audio(element: Element, prosody: _Prosody, out: list[Segment], audio: AudioResolver | None) -> None:
    src = (element.get("src") or "").strip()
    if not src:
        raise SsmlError("<audio> needs src (the name of a configured prompt)")
    resolved = audio(src) if audio is not None else None
    if resolved is not None:
        out.extend(replace(s, prompt=src) if isinstance(s, Speech) else s for s in resolved)
        return
    fallback: list[Segment] = []
    _content(element, prosody, fallback, audio)
    if not any(isinstance(s, Speech) for s in fallback):
        raise SsmlError(f"<audio src={src[:60]!r}>: no configured prompt of that name, and no text inside to "
                        "speak instead")
    out.extend(fallback)


def _break_ms(element: Element) -> int:
    time, strength = element.get("time"), element.get("strength")
    if time is not None:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*", time)
        if not match:
            raise SsmlError(f"<break time={time[:20]!r}>: expected e.g. 500ms or 1.5s")
        ms = round(float(match[1]) * (1000 if match[2] == "s" else 1))
        if ms > MAX_PAUSE_MS:
            raise SsmlError(f"<break time={time[:20]!r}>: at most {MAX_PAUSE_MS // 1000} s")
        return ms
    if strength is not None:
        if strength not in BREAK_STRENGTH_MS:
            raise SsmlError(f"<break strength={strength[:20]!r}>: choose one of {', '.join(BREAK_STRENGTH_MS)}")
        return BREAK_STRENGTH_MS[strength]
    return BREAK_STRENGTH_MS["medium"]


def _rate(value: str | None, current: float) -> float:
    if value is None:
        return current
    value = value.strip()
    if value in RATE_WORDS:
        rate = RATE_WORDS[value]
    elif match := re.fullmatch(r"([+-]?\d+(?:\.\d+)?)%", value):
        number = float(match[1])
        rate = current * (1 + number / 100) if value[0] in "+-" else number / 100
    elif re.fullmatch(r"\d+(?:\.\d+)?", value):
        rate = float(value)
    else:
        raise SsmlError(f"<prosody rate={value[:20]!r}>: expected x-slow..x-fast, a percentage or a number")
    low, high = RATE_RANGE
    if not low <= rate <= high:
        raise SsmlError(f"<prosody rate={value[:20]!r}>: the rate must be between {low:g} and {high:g} of normal")
    return rate


def _volume(value: str | None, current: float) -> float:
    if value is None:
        return current
    value = value.strip()
    if value in VOLUME_WORDS_DB:
        return VOLUME_WORDS_DB[value]
    match = re.fullmatch(r"([+-]?\d+(?:\.\d+)?)\s*dB", value)
    if not match:
        raise SsmlError(f"<prosody volume={value[:20]!r}>: expected silent..x-loud or a change in dB (+6dB)")
    volume = current + float(match[1])
    low, high = VOLUME_RANGE_DB
    if not low <= volume <= high:
        raise SsmlError(f"<prosody volume={value[:20]!r}>: the volume must stay within {low:g}..+{high:g} dB")
    return volume
