"""Which prompt a call hears: the INVITE's X-TTS headers if present, else the route for the dialed number.

`PromptRouter` owns the lookup over the validated config's `routes`, `prompts` and `voices` (aliases):
exact matches win, then the longest prefix ("*" is the empty prefix), ties to the first listed. A call
with neither header nor route raises `NoPrompt` (the call session answers 404). This module only reads
values the config has already validated; it never parses YAML and never refuses a config.

X-TTS headers (set by a PBX dialplan or the operator's test phone): X-TTS-Text (UTF-8, percent-encoding
allowed), optional X-TTS-Voice (a voice or alias), X-TTS-After (`stay` keeps the call up) and
X-TTS-Early-Media (`answer`, `reject` or `ring`, as a route's `early_media`, and over it on a routed
call) with X-TTS-Reject-Code (400-699, default 480). A value outside those raises `BadHeader` (the call
session answers 400).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING
from urllib.parse import unquote

if TYPE_CHECKING:
    from gateway.config import PromptSection, Route
    from gateway.sip.inbound_call import InboundCall


EARLY_MEDIA = ("answer", "reject", "ring")
DEFAULT_REJECT_CODE = 480  # Temporarily Unavailable: what carriers send after "the number is not available"


@dataclass(frozen=True)
class Prompt:
    """What one call says, whether the gateway hangs up once it has been said, and whether it is said as
    early media (before the 200) and what follows it then: answer, reject with `reject_code`, or ring."""

    text: str
    voice: str
    hangup_after: bool = True
    barge_in: bool = False
    early_media: str | None = None  # None | "answer" | "reject" | "ring"
    reject_code: int = DEFAULT_REJECT_CODE


class BadHeader(ValueError):
    """An X-TTS header with a value outside its choices; the message names the header."""


class NoPrompt(Exception):
    """Neither an X-TTS-Text header nor a route for the dialed number."""


PromptResolver = Callable[["InboundCall"], Prompt]


def prompt_from_headers(call: InboundCall, default_voice: str) -> Prompt | None:
    """X-TTS-Text with optional X-TTS-Voice and X-TTS-After; None if absent. A text that is not
    UTF-8 raises UnicodeDecodeError (the call session answers 400)."""
    text = call.invite.header("X-TTS-Text")
    if text is None:
        return None
    voice = call.invite.header("X-TTS-Voice")
    hangup = (call.invite.header("X-TTS-After") or "hangup").strip().lower() != "stay"
    early, code = _early_media_headers(call)
    return Prompt(text=unquote(text, encoding="utf-8", errors="strict").strip(),
                  voice=unquote(voice).strip() if voice else default_voice, hangup_after=hangup,
                  early_media=early, reject_code=code)


def _early_media_headers(call: InboundCall) -> tuple[str | None, int]:
    early = call.invite.header("X-TTS-Early-Media")
    code = call.invite.header("X-TTS-Reject-Code")
    if early is not None:
        early = early.strip().lower()
        if early not in EARLY_MEDIA:
            raise BadHeader(f"X-TTS-Early-Media: expected one of {', '.join(EARLY_MEDIA)}, got {early[:20]!r}")
    if code is None:
        return early, DEFAULT_REJECT_CODE
    if early != "reject":
        raise BadHeader("X-TTS-Reject-Code: only with X-TTS-Early-Media: reject")
    if not code.strip().isdigit() or not 400 <= int(code.strip()) <= 699:
        raise BadHeader(f"X-TTS-Reject-Code: expected a SIP status 400-699, got {code[:20]!r}")
    return early, int(code.strip())


class PromptRouter:
    """INVITE -> Prompt over one config's routes; a reload builds a new router (it holds no state)."""

    def __init__(self, routes: Sequence[Route], prompts: Mapping[str, PromptSection],
                 voice_aliases: Mapping[str, str], default_voice: str) -> None:
        self._routes = tuple(routes)
        self._prompts = prompts
        self._aliases = voice_aliases
        self._default_voice = default_voice

    def __call__(self, call: InboundCall) -> Prompt:
        prompt = prompt_from_headers(call, self._default_voice)
        if prompt is not None:
            return replace(prompt, voice=self._aliases.get(prompt.voice, prompt.voice))
        route = self.route_for(call.request_user)
        if route is None:
            raise NoPrompt(f"no X-TTS-Text header and no route for {call.request_user!r}")
        prompt = self.prompt_for_route(route)
        early, code = _early_media_headers(call)  # the PBX may ask for early media on a routed call too
        return prompt if early is None else replace(prompt, early_media=early, reject_code=code)

    def route_for(self, dialed_user: str) -> Route | None:
        best: Route | None = None
        for route in self._routes:
            if route.prefix is None:
                if route.match == dialed_user:
                    return route
            elif dialed_user.startswith(route.prefix) and (best is None or len(route.prefix) > len(best.prefix or "")):
                best = route
        return best

    def prompt_for_route(self, route: Route) -> Prompt:
        if route.prompt is not None:
            named = self._prompts[route.prompt]
            text, voice, barge_in = named.text, named.voice, named.barge_in or route.barge_in
        else:
            assert route.text is not None  # config validation: a route has a prompt or a text
            text, voice, barge_in = route.text, route.voice, route.barge_in
        voice = voice or self._default_voice
        return Prompt(text=text, voice=self._aliases.get(voice, voice), hangup_after=route.after == "hangup",
                      barge_in=barge_in, early_media=route.early_media,
                      reject_code=route.reject_code or DEFAULT_REJECT_CODE)
