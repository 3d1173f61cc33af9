"""Which prompt a call hears: the INVITE's X-TTS headers if present, else the route for the dialed number.

`PromptRouter` owns the lookup over the validated config's `routes`, `prompts` and `voices` (aliases):
exact matches win, then the longest prefix ("*" is the empty prefix), ties to the first listed. A call
with neither header nor route raises `NoPrompt` (the call session answers 404). This module only reads
values the config has already validated; it never parses YAML and never refuses a config.

X-TTS headers (set by a PBX dialplan or the operator's test phone): X-TTS-Text (UTF-8, percent-encoding
allowed), optional X-TTS-Voice (a voice or alias) and X-TTS-After (`stay` keeps the call up).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING
from urllib.parse import unquote

if TYPE_CHECKING:
    from gateway.config import PromptSection, Route
    from gateway.sip.inbound_call import InboundCall


@dataclass(frozen=True)
class Prompt:
    """What one call says, and whether the gateway hangs up once it has been said."""

    text: str
    voice: str
    hangup_after: bool = True
    barge_in: bool = False
    cache: bool = False  # the prompt cache may keep (and play) this text's audio


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
    cache = (call.invite.header("X-TTS-Cache") or "no").strip().lower() in ("yes", "true", "1")
    return Prompt(text=unquote(text, encoding="utf-8", errors="strict").strip(),
                  voice=unquote(voice).strip() if voice else default_voice, hangup_after=hangup, cache=cache)


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
        return self.prompt_for_route(route)

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
            cache = named.cache and route.cache
        else:
            assert route.text is not None  # config validation: a route has a prompt or a text
            text, voice, barge_in, cache = route.text, route.voice, route.barge_in, route.cache
        voice = voice or self._default_voice
        return Prompt(text=text, voice=self._aliases.get(voice, voice), hangup_after=route.after == "hangup",
                      barge_in=barge_in, cache=cache)

    def prerendered(self) -> list[Prompt]:
        """The prompts and route texts marked `prerender: true`, once each: rendered into the cache at start."""
        prompts = [self.prompt_for_route(route) for route in self._routes
                   if route.prerender or (route.prompt is not None and self._prompts[route.prompt].prerender)]
        prompts += [Prompt(text=p.text, voice=self._aliases.get(v := p.voice or self._default_voice, v), cache=True)
                    for p in self._prompts.values() if p.prerender]
        return list({(p.text, p.voice): p for p in prompts if p.cache}.values())
