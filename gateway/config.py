"""The gateway's configuration: one YAML file validated at start into typed, frozen objects.

Operators write keys named after what they think of (sip, trunks, media, engine, voices, prompts,
routes, http, logging, shutdown, mrcp); every section has defaults that work on loopback, and with no file
at all `EMBEDDED_DEFAULT` applies (SIP on 127.0.0.1:5060 UDP+TCP, HTTP on 127.0.0.1:8080, the espeak
engine, two demo routes). A wrong key or value raises `ConfigError` whose message starts with the key
path, e.g. `routes[2].voice: unknown field` or `sip.listen: expected HOST:PORT`.

Security default: `trunks` lists who may send INVITEs. With no trunks only loopback sources
(127.0.0.0/8, ::1) are accepted; a PBX must be listed before it can reach the gateway.

This module owns the top-level schema and the loader; the engine block lives in
gateway/engine_config.py, the value types (HOST:PORT, CIDR, port range) in gateway/config_types.py,
and the wording of errors in gateway/config_errors.py. The SIP and media packages take their own settings
objects; `sip_settings()` / `media_settings()` build those, and `prompt_resolver()` builds the
route lookup (gateway/routing.py), all imported lazily so the config can be loaded and checked
without them. Nothing here reads environment variables.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import (
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engines.ssml import Segment, Speech, SsmlError, is_ssml, parse_ssml
from gateway.config_errors import ConfigError, FieldProblem, describe
from gateway.config_types import (
    HostPort,
    HttpCapsSection,
    IPNetwork,
    ListenAddress,
    LocalAddress,
    Network,
    PortRange,
    ReachableHost,
    Section,
)
from gateway.engine_config import EngineSection, WorkerPlan

if TYPE_CHECKING:
    from gateway.routing import PromptRouter

LOOPBACK_SOURCES: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# What gateway.media answers with (G.711 only; telephone-event is added whenever offered).
SUPPORTED_CODECS = ("PCMU", "PCMA", "G722")  # gateway/media/codecs.py
_WILDCARD_HOSTS = ("0.0.0.0", "::")

EMBEDDED_DEFAULT: dict[str, Any] = {
    "prompts": {
        "welcome": {"text": "Hello! This is the CosyVoice gateway. Your call is working. Goodbye.", "voice": "en"},
        "welcome_zh": {"text": "您好，这里是语音网关。您的电话已经接通。再见。", "voice": "zh"},
    },
    "routes": [
        {"match": "1000", "prompt": "welcome"},
        {"match": "2000", "prompt": "welcome_zh"},
    ],
}


# -- sections ------------------------------------------------------------------------------------
class SipTcpSection(Section):
    """What one TCP peer may cost (sip.tcp); the total is also kept below the process's descriptor limit."""

    max_connections: int = Field(500, ge=1)
    max_connections_per_source: int = Field(50, ge=1)
    idle_timeout_s: float = Field(60.0, gt=0)  # no byte at all for this long: close
    read_timeout_s: float = Field(10.0, gt=0)  # a message begun must arrive whole within this
    max_unsent_bytes: int = Field(262144, ge=4096)  # queued for a peer that does not read: over it, close

    @model_validator(mode="after")
    def _per_source_within_total(self) -> SipTcpSection:
        if self.max_connections_per_source > self.max_connections:
            raise FieldProblem("max_connections_per_source", "must not exceed max_connections")
        return self


class SipFloodSection(Section):
    """Budgets checked before parsing (sip.flood, gateway/sip/rate_limit.py); bursts of twice each pass.
    Over one: a few cheap 503s, the rest dropped; requests of live calls pass regardless."""

    max_requests_per_s_per_source: float = Field(100.0, gt=0)
    max_requests_per_s: float = Field(500.0, gt=0)  # all sources together: protects the packet clock
    max_junk_per_s_per_source: float = Field(10.0, gt=0)  # what does not start like SIP: its own budget
    max_junk_per_s: float = Field(100.0, gt=0)

    @model_validator(mode="after")
    def _totals_cover_one_source(self) -> SipFloodSection:
        if self.max_requests_per_s < self.max_requests_per_s_per_source:
            raise FieldProblem("max_requests_per_s", "must not be below max_requests_per_s_per_source")
        if self.max_junk_per_s < self.max_junk_per_s_per_source:
            raise FieldProblem("max_junk_per_s", "must not be below max_junk_per_s_per_source")
        return self

    def limits(self):
        from gateway.sip.rate_limit import FloodLimits

        return FloodLimits(self.max_requests_per_s_per_source, self.max_requests_per_s,
                           self.max_junk_per_s_per_source, self.max_junk_per_s)


class SipSessionTimersSection(Section):
    """RFC 4028 session timers (sip.session_timers): a call that nobody refreshes ends with our BYE."""

    enabled: bool = True
    expires_s: int = Field(1800, ge=1)  # the interval we ask for when the INVITE names none (RFC 4028 §4)
    min_se_s: int = Field(90, ge=1)  # smaller Session-Expires get 422; RFC 4028 §4 puts the floor at 90

    @model_validator(mode="after")
    def _expires_above_minimum(self) -> SipSessionTimersSection:
        if self.expires_s < self.min_se_s:
            raise FieldProblem("expires_s", f"must be at least min_se_s ({self.min_se_s})")
        return self


class SipSection(Section):
    listen: ListenAddress = HostPort("127.0.0.1", 5060)
    transports: tuple[Literal["udp", "tcp"], ...] = ("udp", "tcp")
    # The address put in Contact and in the Via of our BYE (and the SDP unless media.advertised_address says
    # otherwise): a public or 1:1 NAT address may be used here while `listen` binds a local one. Default:
    # listen's host; required when listening on all interfaces.
    advertised_host: ReachableHost | None = None
    max_calls: int = Field(100, ge=1)
    retry_after_s: int = Field(5, ge=1)  # Retry-After on 503 while full or draining
    # RFC 3261 §17.1.1.1 timers; change only for links with unusual round-trip times.
    t1_ms: int = Field(500, ge=1)
    t2_ms: int = Field(4000, ge=1)
    t4_ms: int = Field(5000, ge=1)
    user_agent: str = "cosyvoice-gateway"
    max_message_bytes: int = Field(65535, ge=1500, le=1048576)  # one message, headers + body
    tcp: SipTcpSection = SipTcpSection()
    flood: SipFloodSection = SipFloodSection()
    session_timers: SipSessionTimersSection = SipSessionTimersSection()

    @field_validator("transports")
    @classmethod
    def _some_transport(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("at least one of udp, tcp")
        if len(set(value)) != len(value):
            raise ValueError("listed twice")
        return value

    @model_validator(mode="after")
    def _reachable(self) -> SipSection:
        if self.advertised_host is None and self.listen.host in _WILDCARD_HOSTS:
            raise FieldProblem("advertised_host", f"required when listen binds all interfaces ({self.listen})")
        if self.t1_ms > self.t2_ms:
            raise FieldProblem("t1_ms", "must not exceed t2_ms")
        return self

    @property
    def public_host(self) -> str:
        return self.advertised_host or self.listen.host


class Trunk(Section):
    name: str = Field(min_length=1)
    allow: tuple[Network, ...]

    @field_validator("allow")
    @classmethod
    def _not_empty(cls, value: tuple[IPNetwork, ...]) -> tuple[IPNetwork, ...]:
        if not value:
            raise ValueError("list at least one address or CIDR the trunk sends from")
        return value


class MediaSection(Section):
    rtp_port_range: PortRange = (20000, 30000)
    # Where the RTP/RTCP sockets bind: an address of this host (checked at start). Default: sip.listen's host,
    # or all interfaces when SIP listens on all.
    bind_address: LocalAddress | None = None
    # The address the SDP answer gives callers (c=, o=), like Asterisk's external_media_address: a public or
    # 1:1 NAT address need not be local. Default: sip.advertised_host, else sip.listen's host.
    advertised_address: ReachableHost | None = None
    codecs: tuple[str, ...] = SUPPORTED_CODECS  # those we answer with, in our order of preference
    # Whose order picks the codec: "offer" (the caller's, RFC 3264 §6.1: G.722 when the offer lists it first) or
    # "config" (the first of media.codecs the offer has: G.722 whenever offered, if listed first).
    codec_order: Literal["offer", "config"] = "offer"
    initial_playout_delay_ms: int = Field(60, ge=0, le=2000)
    max_playout_delay_ms: int = Field(400, ge=20, le=10000)
    rtcp_interval_s: float = Field(5.0, gt=0)
    # Where our RTP goes and whose RTP counts. off: the address the SDP names, nothing else (phones
    # that are reachable where their SDP says). sdp_host: latch to the first packet from the SDP's
    # host, any port (NAT that rewrites ports). signalling_source: also from the host the INVITE came
    # from (phones behind NAT whose SDP names a private address). RTP from any other source is dropped.
    rtp_latching: Literal["off", "sdp_host", "signalling_source"] = "off"
    dtmf_max_per_second: float = Field(10.0, gt=0, le=1000)  # per call; more key presses are dropped
    # No RTP or RTCP from the caller for this long (hold excepted) ends the call with BYE; 0 turns it off.
    inactivity_timeout_s: float = Field(60.0, ge=0)
    # The same while the call is on hold (many phones send nothing then); 0 turns it off.
    hold_timeout_s: float = Field(300.0, ge=0)
    # Active speech level of what leaves (ITU-T P.56-style, measured once per voice), in dBm0; -19 is the
    # telephony target (RFC 7874 §4, ITU-T G.169). null: as the engine makes it. A peak limiter keeps every
    # sample at or below a 0 dBm0 sine's peak (speech_audio/level.py).
    speech_level_dbm0: float | None = Field(-19.0, ge=-40.0, le=-6.0)

    @field_validator("codecs", mode="before")
    @classmethod
    def _known_codecs(cls, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(f"expected a list of codecs from {', '.join(SUPPORTED_CODECS)}")
        names = tuple(str(name).upper() for name in value)
        unknown = [name for name in names if name not in SUPPORTED_CODECS]
        if unknown:
            raise ValueError(f"unsupported codec {', '.join(unknown)}; supported: {', '.join(SUPPORTED_CODECS)}")
        return names

    @field_validator("rtp_latching", mode="before")
    @classmethod
    def _yaml_off(cls, value: Any) -> Any:
        return "off" if value is False else value  # YAML 1.1 reads an unquoted `off` as false

    @model_validator(mode="after")
    def _delays(self) -> MediaSection:
        if self.initial_playout_delay_ms > self.max_playout_delay_ms:
            raise FieldProblem("initial_playout_delay_ms", "must not exceed max_playout_delay_ms")
        return self


class PromptSection(Section):
    text: str = Field(min_length=1)
    voice: str | None = None  # a voice or alias; the engine's default when absent
    barge_in: bool = False  # a key press (DTMF) stops the prompt
    cache: bool = True  # the prompt cache keeps its audio (prompt_cache)
    prerender: bool = False  # render it into the cache at start, so even the first caller hears a hit


class PromptCacheSection(Section):
    """Rendered prompts kept for the next caller (speech_audio/prompt_cache.py): in memory, and in `directory`
    (if set) across restarts. The systemd unit's cache directory is /var/cache/cosyvoice-gateway; the shipped
    configs use its `prompts` folder. Without a directory (the default for a plain run, which should not write
    outside its working files unasked) entries live in memory only."""

    enabled: bool = True  # false: every call synthesises (voice level measurements are still kept)
    directory: str | None = Field(None, min_length=1)
    max_memory_mb: float = Field(64.0, gt=0)
    max_disk_mb: float | None = Field(1024.0, gt=0)  # null: no bound


class Route(Section):
    """Dialed user part -> what to say. `match`: exact ("1000"), prefix ("49301*") or "*" (any)."""

    match: str = Field(min_length=1)
    prompt: str | None = None
    text: str | None = Field(None, min_length=1)
    voice: str | None = None
    after: Literal["hangup", "stay"] = "hangup"
    barge_in: bool = False
    # Speak the prompt as early media (183 with SDP, before any 200), then: answer (200 OK, the same RTP
    # stream goes on, then `after`), reject (with reject_code: an announcement, then the failure) or
    # ring (stay in 183 until the caller cancels). Absent: answer first, as usual.
    early_media: Literal["answer", "reject", "ring"] | None = None
    reject_code: int | None = Field(None, ge=400, le=699)  # with early_media: reject; default 480
    cache: bool = True  # with a named prompt, both must allow it
    prerender: bool = False
    # CosyVoice3 models only (another engine refuses the call with 400): one of the authors' instruct names
    # (loud, soft, slow, fast, happy, sad, angry, peppa_pig, robot) or dialects (cantonese, sichuan, ...; README).
    # The engine checks the name against its model's list; never both.
    instruct: str | None = Field(None, min_length=1)
    dialect: str | None = Field(None, min_length=1)

    @field_validator("match")
    @classmethod
    def _pattern(cls, value: str) -> str:
        if any(ch.isspace() for ch in value) or "*" in value[:-1]:
            raise ValueError("expected a number, a prefix ending in * (e.g. 4930*), or *")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Route:
        if (self.prompt is None) == (self.text is None):
            raise FieldProblem("prompt", "give either prompt (a name from prompts) or text")
        if self.voice is not None and self.prompt is not None:
            raise FieldProblem("voice", "only with text; a named prompt carries its own voice")
        if self.reject_code is not None and self.early_media != "reject":
            raise FieldProblem("reject_code", "only with early_media: reject")
        if self.instruct is not None and self.dialect is not None:
            raise FieldProblem("dialect", "give instruct or dialect, not both (CosyVoice3 takes one per request)")
        return self

    @property
    def engine_options(self) -> tuple[tuple[str, str], ...]:
        return tuple((key, value) for key, value in (("instruct", self.instruct), ("dialect", self.dialect))
                     if value is not None)

    @property
    def prefix(self) -> str | None:
        return self.match[:-1] if self.match.endswith("*") else None


class HttpSection(HttpCapsSection):
    listen: ListenAddress = HostPort("127.0.0.1", 8080)


class LoggingSection(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_: bool = Field(True, alias="json")
    file: str | None = Field(None, min_length=1)  # append here instead of stderr; SIGHUP reopens it (logrotate)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class MrcpTlsSection(Section):
    """TCP/TLS/MRCPv2 (RFC 6787 §4.2 requires servers to offer it): a second listener with this certificate."""

    listen: ListenAddress = HostPort("127.0.0.1", 1545)
    cert: str = Field(min_length=1)  # PEM certificate chain
    key: str = Field(min_length=1)  # PEM private key

    @model_validator(mode="after")
    def _loadable(self) -> MrcpTlsSection:
        import ssl

        for field, path in (("cert", self.cert), ("key", self.key)):
            if not Path(path).is_file():
                raise FieldProblem(field, f"no such file: {path}")
        try:
            ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.cert, self.key)
        except (ssl.SSLError, OSError) as exc:
            raise FieldProblem("cert", f"certificate {self.cert} and key {self.key} do not load together: "
                                       f"{getattr(exc, 'reason', None) or exc}") from None
        return self


class MrcpSection(Section):
    """The MRCPv2 synthesizer server (gateway/mrcp/): INVITEs offering TCP/MRCPv2 on the SIP port, their
    control connections on `listen`. Off by default; with it off such an INVITE gets 488."""

    enabled: bool = False
    # Clients connect to the SDP's c= address (sip.advertised_host or sip.listen's host) at this port.
    listen: ListenAddress = HostPort("127.0.0.1", 1544)
    max_connections: int = Field(200, ge=1)
    max_message_bytes: int = Field(65536, ge=1024, le=1048576)  # one MRCP message; more: 504 and closed
    idle_timeout_s: float = Field(3600.0, gt=0)  # no byte on a control connection this long: closed
    # A session with no control connection this long (never opened, or closed and not reopened) gets our BYE:
    # a client gone without one must not hold its RTP ports and sip.max_calls place.
    unattached_timeout_s: float = Field(30.0, gt=0)
    tls: MrcpTlsSection | None = None


class ShutdownSection(Section):
    drain_timeout_s: float = Field(30.0, ge=0)


# -- the whole file ------------------------------------------------------------------------------
class GatewayConfig(Section):
    sip: SipSection = SipSection()
    trunks: tuple[Trunk, ...] = ()
    media: MediaSection = MediaSection()
    engine: EngineSection = EngineSection()
    voices: dict[str, str] = Field(default_factory=dict)  # alias -> engine voice
    prompts: dict[str, PromptSection] = Field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    prompt_cache: PromptCacheSection = PromptCacheSection()
    http: HttpSection = HttpSection()
    logging: LoggingSection = LoggingSection()
    shutdown: ShutdownSection = ShutdownSection()
    mrcp: MrcpSection = MrcpSection()
    # The speech API (HTTP, WebSocket, jambonz) the engine workers serve; its keys are checked by the
    # worker at start (engine_service/api/settings.py), a mistake there stops the start with exit 2.
    tts_api: dict[str, Any] | None = None

    def worker_plans(self) -> list[WorkerPlan]:
        """The engine's worker processes, logging at the gateway's level and prepared for its prompts, each also
        serving the speech API when `tts_api` is set (which needs fixed ports, engine.worker.port: an API on a free
        port would have no client that knows where it is; `_references` refuses the config without one)."""
        return [dataclasses.replace(plan, tts_api=self.tts_api, log_level=self.logging.level,
                                    prompt_texts=self.prompt_texts())
                for plan in self.engine.worker_plans()]

    def prompt_texts(self) -> tuple[str, ...]:
        """Every text the config speaks (prompts, then routes' inline texts), once each, for `engine.prepare`; an
        SSML text as the texts of its speech segments, which are what the engine is asked to say."""
        texts = [prompt.text for prompt in self.prompts.values()] + [route.text for route in self.routes if route.text]
        spoken = [segment.text for text in texts for segment in self._segments(text) if isinstance(segment, Speech)]
        return tuple(dict.fromkeys(spoken))

    def _segments(self, text: str) -> tuple[Segment, ...]:
        """A configured text as the engine gets it (plain text: one segment); raises SsmlError."""
        if not is_ssml(text):
            return (Speech(text),)
        return parse_ssml(text, lambda src: (Speech(self.prompts[src].text),) if src in self.prompts else None)

    @model_validator(mode="after")
    def _references(self) -> GatewayConfig:
        problems = []
        names = [trunk.name for trunk in self.trunks]
        problems += [f"trunks[{i}].name: {name!r} is used twice" for i, name in enumerate(names) if name in names[:i]]
        defined = ", ".join(self.prompts) or "none"
        problems += [f"routes[{i}].prompt: unknown prompt {route.prompt!r}; defined: {defined}"
                     for i, route in enumerate(self.routes)
                     if route.prompt is not None and route.prompt not in self.prompts]
        known = self.engine.configured_voices()
        if known is not None:
            problems += self.unknown_voices(known)
        problems += self._media_address_problems()
        if self.tts_api is not None and self.engine.worker_plans() and self.engine.worker.port is None:
            problems.append("tts_api: supervised workers serve the speech API only on fixed ports: set "
                            "engine.worker.port (worker i listens on port + i), or remove tts_api")
        texts = [(f"prompts.{name}.text", prompt.text) for name, prompt in self.prompts.items()]
        texts += [(f"routes[{i}].text", route.text) for i, route in enumerate(self.routes) if route.text]
        for where, text in texts:
            try:
                self._segments(text)
            except SsmlError as exc:
                problems.append(f"{where}: {exc}")
        if problems:
            raise ValueError("@@" + "\n".join(problems))
        return self

    def _media_address_problems(self) -> list[str]:
        """RTP's sockets and the SDP's address must be of one family (an IPv4 socket cannot reach an IPv6 caller)."""
        try:
            advertised = ipaddress.ip_address(self.media_advertised_host)
            bound = ipaddress.ip_address(self.media_bind_host)
        except ValueError:  # a name: its family is the resolver's business
            return []
        if advertised.version == bound.version:
            return []
        key = "media.advertised_address" if self.media.advertised_address else "sip.advertised_host"
        return [f"{key}: {advertised} is IPv{advertised.version} but RTP binds IPv{bound.version} {bound} "
                "(media.bind_address): use one family for both"]

    # -- what the rest of the gateway asks ---------------------------------------------------------
    @property
    def media_bind_host(self) -> str:
        """Where RTP binds: media.bind_address, else sip.listen's host (its wildcard when SIP listens on all)."""
        if self.media.bind_address is not None:
            return self.media.bind_address
        host = self.sip.listen.host
        if host not in _WILDCARD_HOSTS:
            return host  # an address, or a name (localhost) the bind resolves
        try:  # all interfaces, of the family callers are told to send to
            return "::" if ipaddress.ip_address(self.media_advertised_host).version == 6 else "0.0.0.0"
        except ValueError:  # an advertised name
            return host

    @property
    def media_advertised_host(self) -> str:
        """The SDP's address: media.advertised_address, else what SIP advertises."""
        return self.media.advertised_address or self.sip.public_host

    @property
    def allowed_sources(self) -> tuple[IPNetwork, ...]:
        networks = tuple(network for trunk in self.trunks for network in trunk.allow)
        return networks or LOOPBACK_SOURCES

    @property
    def http_host(self) -> str:
        return self.http.listen.host

    @property
    def http_port(self) -> int:
        return self.http.listen.port

    def resolve_voice(self, voice: str) -> str:
        return self.voices.get(voice, voice)

    def unknown_voices(self, engine_voices: Sequence[str]) -> list[str]:
        """'key: problem' lines for prompts/routes whose voice the engine does not have."""
        known = set(engine_voices)
        uses = [(f"prompts.{name}.voice", p.voice) for name, p in self.prompts.items()]
        uses += [(f"routes[{i}].voice", r.voice) for i, r in enumerate(self.routes)]
        uses += [(f"voices.{alias}", target) for alias, target in self.voices.items()]
        return [f"{key}: {voice!r} is not a voice of engine {self.engine.name} ({', '.join(sorted(known))})"
                for key, voice in uses if voice is not None and self.resolve_voice(voice) not in known]

    def check_voices(self, engine_voices: Sequence[str]) -> None:
        """For engines that find their voices at start (cosyvoice2): refuse a config naming missing ones."""
        problems = self.unknown_voices(engine_voices)
        if problems:
            raise ConfigError(problems)

    def engine_settings(self) -> dict[str, Any]:
        return self.engine.settings()

    def rtp_descriptors(self) -> int:
        """Descriptors RTP/RTCP may need at once (two sockets per call, at most the port range's ports):
        the connection listeners' shared budget keeps them free (connection_caps.DescriptorBudget)."""
        low, high = self.media.rtp_port_range
        return min(high - low + 1, 2 * self.sip.max_calls)

    def sip_settings(self, budget=None):
        """`budget`: the descriptor budget SIP TCP shares with the HTTP port (connection_caps), if any."""
        from gateway.sip.session_timer import SessionTimerSettings
        from gateway.sip.transport import StreamLimits
        from gateway.sip.uas import SipSettings

        sip = self.sip
        timers = sip.session_timers
        return SipSettings(listen_host=sip.listen.host, listen_port=sip.listen.port, transports=sip.transports,
                           allowed_sources=self.allowed_sources, max_calls=sip.max_calls,
                           retry_after_s=sip.retry_after_s, t1=sip.t1_ms / 1000, t2=sip.t2_ms / 1000,
                           t4=sip.t4_ms / 1000, user_agent=sip.user_agent, advertised_host=sip.public_host,
                           stream_limits=StreamLimits(sip.tcp.max_connections, sip.tcp.max_connections_per_source,
                                                      sip.tcp.idle_timeout_s, sip.tcp.read_timeout_s,
                                                      sip.max_message_bytes, budget=budget,
                                                      max_unsent_bytes=sip.tcp.max_unsent_bytes),
                           flood=sip.flood.limits(),
                           session_timers=SessionTimerSettings(timers.enabled, timers.expires_s, timers.min_se_s))

    def media_settings(self):
        from gateway.media.call_media import MediaSettings

        media = self.media
        return MediaSettings(bind_host=self.media_bind_host, advertised_host=self.media_advertised_host,
                             bind_key="media.bind_address" if media.bind_address is not None else "sip.listen",
                             rtp_port_min=media.rtp_port_range[0],
                             rtp_port_max=media.rtp_port_range[1], codecs=media.codecs,
                             codec_order=media.codec_order,
                             initial_playout_delay_ms=media.initial_playout_delay_ms,
                             max_playout_delay_ms=media.max_playout_delay_ms, rtcp_interval_s=media.rtcp_interval_s,
                             rtp_latching=media.rtp_latching, dtmf_max_per_second=media.dtmf_max_per_second,
                             inactivity_timeout_s=media.inactivity_timeout_s, hold_timeout_s=media.hold_timeout_s)

    def mrcp_settings(self):
        """The MRCP server's settings, or None when `mrcp.enabled` is false."""
        if not self.mrcp.enabled:
            return None
        from gateway.mrcp.server import MrcpSettings

        mrcp = self.mrcp
        return MrcpSettings(listen_host=mrcp.listen.host, listen_port=mrcp.listen.port,
                            max_connections=mrcp.max_connections, max_message_bytes=mrcp.max_message_bytes,
                            idle_timeout_s=mrcp.idle_timeout_s, unattached_timeout_s=mrcp.unattached_timeout_s,
                            voice_aliases=tuple(self.voices.items()),
                            tls_listen=(mrcp.tls.listen.host, mrcp.tls.listen.port) if mrcp.tls else None,
                            tls_cert=mrcp.tls.cert if mrcp.tls else None, tls_key=mrcp.tls.key if mrcp.tls else None)
    def speech_settings(self):
        from gateway.speech import SpeechSettings

        cache = self.prompt_cache
        return SpeechSettings(cache_enabled=cache.enabled,
                              cache_directory=Path(cache.directory) if cache.directory else None,
                              max_memory_bytes=int(cache.max_memory_mb * (1 << 20)),
                              max_disk_bytes=None if cache.max_disk_mb is None else int(cache.max_disk_mb * (1 << 20)),
                              level_dbm0=self.media.speech_level_dbm0)

    def prompt_resolver(self, default_voice: str | None = None) -> PromptRouter:
        """INVITE -> Prompt over these routes and prompts (gateway/routing.py owns the lookup).

        Pass the running engine's `default_voice`; without it the engine block's default is used.
        """
        from gateway.routing import PromptRouter

        return PromptRouter(self.routes, self.prompts, self.voices, default_voice or self.engine.default_voice)


# -- loading -------------------------------------------------------------------------------------
def load_config(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None) -> GatewayConfig:
    """Read and validate; `overrides` maps dotted keys ("sip.listen") to values applied before validation."""
    raw = _read_yaml(Path(path)) if path is not None else _deep_copy(EMBEDDED_DEFAULT)
    for dotted, value in (overrides or {}).items():
        _apply_override(raw, dotted, value)
    try:
        return GatewayConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(describe(exc)) from None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read ({exc.strerror})"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError([f"{path}:{where} not valid YAML: {getattr(exc, 'problem', exc)}"]) from None
    if data is None or data == {}:
        # An empty file (a truncated write, a deploy that lost its content) would start, or reload, with no
        # routes and the loopback-only allow-list: every routed call 404 while /healthz says 200.
        raise ConfigError([f"{path}: the file is empty; expected sections such as sip, trunks, routes "
                           "(start without --config for the built-in loopback config)"])
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping of sections (sip, trunks, routes, ...) at the top"])
    return data


def _deep_copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _deep_copy(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_deep_copy(item) for item in value]
    return value


def _apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = raw
    for depth, key in enumerate(parents):
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError([f"{'.'.join(parents[: depth + 1])}: expected a mapping to override {dotted}"])
        node = child
    node[leaf] = value
