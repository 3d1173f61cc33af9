"""What a parsed SSML document is to an engine: speech and pauses, in order.

An engine speaks `Speech` segments in order with `Pause`s of real silence between them; it never sees markup.
Both are frozen values so they cross threads and the gateway-worker protocol (`to_wire`/`from_wire`) unchanged.
"""

from __future__ import annotations

import re

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_PAUSE_MS = 10_000  # one <break> at most; longer is a mistake, not a prompt (Polly and Azure cap there too)


@dataclass(frozen=True)
class Speech:
    """Words to speak, with their prosody: `rate` 1.0 is the voice's own pace; `volume_db` a gain in dB.
    `prompt` names the configured prompt this text came from (`<audio src=>`), so a prompt cache may play
    its stored audio instead of synthesising it."""

    text: str
    rate: float = 1.0
    volume_db: float = 0.0
    prompt: str | None = None


@dataclass(frozen=True)
class Pause:
    ms: int


Segment = Speech | Pause


def spoken_text(segments: Iterable[Segment]) -> str:
    """The words of all speech segments, for validation, logs and engines that take one text."""
    return " ".join(s.text for s in segments if isinstance(s, Speech)).strip()


def merged(segments: Iterable[Segment]) -> tuple[Segment, ...]:
    """Neighbours with the same prosody joined as written (fewer, longer engine requests: better intonation),
    whitespace collapsed, pauses in a row added; empty speech and zero pauses dropped."""
    joined: list[Segment] = []
    for segment in segments:
        last = joined[-1] if joined else None
        if isinstance(segment, Speech) and isinstance(last, Speech) and \
                (last.rate, last.volume_db, last.prompt) == (segment.rate, segment.volume_db, segment.prompt):
            joined[-1] = Speech(last.text + segment.text, last.rate, last.volume_db, last.prompt)
        elif isinstance(segment, Pause) and isinstance(last, Pause):
            joined[-1] = Pause(min(MAX_PAUSE_MS, last.ms + segment.ms))
        else:
            joined.append(segment)
    out: list[Segment] = []
    for segment in joined:
        if isinstance(segment, Speech):
            segment = Speech(_tidy(segment.text), segment.rate, segment.volume_db, segment.prompt)
            if segment.text:
                out.append(segment)
        elif segment.ms > 0:
            out.append(segment)
    return tuple(out)


_SPACES = re.compile(r"\s+")
# A space touching a CJK character or full-width punctuation is markup's, not the text's: Mandarin has none.
_CJK_SPACE = re.compile(r"(?<=[\u3000-\u9fff\uff00-\uffef]) | (?=[\u3000-\u9fff\uff00-\uffef])")


def _tidy(text: str) -> str:
    return _CJK_SPACE.sub("", _SPACES.sub(" ", text).strip())


def to_wire(segments: Sequence[Segment]) -> list[dict[str, Any]]:
    return [{"pause_ms": s.ms} if isinstance(s, Pause) else
            {"text": s.text, "rate": s.rate, "volume_db": s.volume_db, **({"prompt": s.prompt} if s.prompt else {})}
            for s in segments]


def from_wire(items: Sequence[Any]) -> tuple[Segment, ...]:
    """The protocol's segment list; ValueError names the item that is neither speech nor pause."""
    out: list[Segment] = []
    for index, item in enumerate(items):
        if isinstance(item, dict) and isinstance(item.get("pause_ms"), int) and 0 <= item["pause_ms"] <= MAX_PAUSE_MS:
            out.append(Pause(item["pause_ms"]))
        elif isinstance(item, dict) and isinstance(item.get("text"), str):
            rate, volume = item.get("rate", 1.0), item.get("volume_db", 0.0)
            if not isinstance(rate, (int, float)) or not isinstance(volume, (int, float)):
                raise ValueError(f"segments[{index}]: rate and volume_db must be numbers")
            prompt = item.get("prompt")
            out.append(Speech(item["text"], float(rate), float(volume), prompt if isinstance(prompt, str) else None))
        else:
            raise ValueError(f"segments[{index}]: expected {{text, rate, volume_db}} or {{pause_ms}} (0-{MAX_PAUSE_MS})")
    return tuple(out)
