"""Which prompt a call hears: the INVITE's X-TTS headers if present, else the route for the dialed number.

`PromptRouter` owns the lookup over the validated config's `routes`, `prompts` and `voices` (aliases):
exact matches win, then the longest prefix ("*" is the empty prefix), ties to the first listed. A call
with neither header nor route raises `NoPrompt` (the call session answers 404). This module only reads
values the config has already validated; it never parses YAML and never refuses a config.

X-TTS headers (set by a PBX dialplan or the operator's test phone): X-TTS-Text (UTF-8, percent-encoding
allowed), optional X-TTS-Voice (a voice or alias), X-TTS-After (`stay` keeps the call up),
X-TTS-Early-Media (`answer`, `reject` or `ring`, as a route's `early_media`, and over it on a routed
call) with X-TTS-Reject-Code (400-699, default 480), X-TTS-Type (`ssml` or `text`; without it a
text starting with `<speak` is SSML, for headers, routes and prompts alike), and X-TTS-Instruct or
X-TTS-Dialect (a CosyVoice3 instruct or dialect name, as a route's `instruct`/`dialect`, and over it on a
routed call; the engine checks the name). A header value outside its choices raises `BadHeader`. SSML is parsed here, once, by engines.ssml (`<audio src=>` names a configured
prompt); a document that cannot be spoken raises SsmlError (the call session answers 400 for either).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING
from urllib.parse import unquote

from engines.segmented import speech_request
from engines.ssml import Segment, Speech, SsmlError

if TYPE_CHECKING:
    from gateway.config_sections import PromptSection, Route
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
    ssml: bool | None = None  # X-TTS-Type; None: SSML when the text starts with <speak
    segments: tuple[Segment, ...] = ()  # parsed SSML (and then `text` is its words)
    cache: bool = False  # the prompt cache may keep (and play) this text's audio
    options: tuple[tuple[str, str], ...] = ()  # engine options: ("instruct", name) or ("dialect", name)


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
    kind = (call.invite.header("X-TTS-Type") or "").strip().lower()
    if kind not in ("", "text", "ssml"):
        raise SsmlError(f"X-TTS-Type {kind[:20]!r}: expected text or ssml")
    cache = (call.invite.header("X-TTS-Cache") or "no").strip().lower() in ("yes", "true", "1")
    return Prompt(text=unquote(text, encoding="utf-8", errors="strict").strip(),
                  voice=unquote(voice).strip() if voice else default_voice, hangup_after=hangup,
                  early_media=early, reject_code=code, ssml={"": None, "text": False, "ssml": True}[kind],
                  cache=cache, options=_instruct_headers(call))


def _instruct_headers(call: InboundCall) -> tuple[tuple[str, str], ...]:
    """X-TTS-Instruct / X-TTS-Dialect as engine options (at most one of them)."""
    found = tuple((key, unquote(value).strip().lower()) for key, header in (("instruct", "X-TTS-Instruct"),
                                                                           ("dialect", "X-TTS-Dialect"))
                  if (value := call.invite.header(header)) is not None)
    if len(found) > 1:
        raise BadHeader("X-TTS-Instruct and X-TTS-Dialect: give one (CosyVoice3 takes one instruct per call)")
    if found and not found[0][1]:
        raise BadHeader(f"X-TTS-{found[0][0].capitalize()}: empty")
    return found


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
            return self._parsed(replace(prompt, voice=self._aliases.get(prompt.voice, prompt.voice)))
        route = self.route_for(call.request_user)
        if route is None:
            raise NoPrompt(f"no X-TTS-Text header and no route for {call.request_user!r}")
        prompt = self._parsed(self.prompt_for_route(route))
        early, code = _early_media_headers(call)  # the PBX may ask for early media on a routed call too
        if early is not None:
            prompt = replace(prompt, early_media=early, reject_code=code)
        options = _instruct_headers(call)  # and for an instruct or dialect over the route's
        return prompt if not options else replace(prompt, options=options)

    def _parsed(self, prompt: Prompt) -> Prompt:
        """The prompt with its SSML segments, if it is SSML; raises SsmlError."""
        request = speech_request(prompt.text, prompt.voice, ssml=prompt.ssml, audio=self.prompt_segments)
        return replace(prompt, text=request.text, segments=request.segments)

    def prompt_segments(self, name: str) -> tuple[Segment, ...] | None:
        """`<audio src=NAME>`: the configured prompt NAME as segments (its own `<audio>` is not followed), or
        None when there is no such prompt. The prompt cache plugs in behind `Speech.prompt`, which names it."""
        named = self._prompts.get(name)
        if named is None:
            return None
        return speech_request(named.text, named.voice or self._default_voice).segments or (Speech(named.text),)

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
                      barge_in=barge_in, early_media=route.early_media,
                      reject_code=route.reject_code or DEFAULT_REJECT_CODE, cache=cache, options=route.engine_options)

    def prerendered(self) -> list[Prompt]:
        """The prompts and route texts marked `prerender: true`, once each, SSML left out: rendered into the cache
        at start, at the G.711 rate (8 kHz; a G.722 call fills the 16 kHz entry on its first call)."""
        prompts = [self.prompt_for_route(route) for route in self._routes
                   if route.prerender or (route.prompt is not None and self._prompts[route.prompt].prerender)]
        prompts += [Prompt(text=p.text, voice=self._aliases.get(v := p.voice or self._default_voice, v), cache=True)
                    for p in self._prompts.values() if p.prerender]
        return list({(p.text, p.voice, p.options): p for p in prompts if p.cache and not self._is_ssml(p)}.values())

    def _is_ssml(self, prompt: Prompt) -> bool:
        """SSML prompts are not cached (gateway/call.py), so they are not prerendered either."""
        try:
            return bool(self._parsed(prompt).segments)
        except SsmlError:
            return True
