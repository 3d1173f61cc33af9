"""The schema of the gateway config's sections other than `engine`: sip (with its tcp, flood and session_timers
blocks), trunks, media, prompts, prompt_cache, routes, http, logging, mrcp, shutdown.

Each section is a frozen `Section` whose validators check the section on its own and raise `FieldProblem` or
`ValueError` naming the field; checks that need two sections (a route's prompt, voices, media address families)
belong to `GatewayConfig` in gateway/config.py, which assembles these into the whole file and loads it.
Nothing here reads files or environment variables.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from gateway.config_errors import FieldProblem
from gateway.config_types import (
    ConnectionCapsSection,
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

# INVITEs are accepted from these when no trunk is configured (the security default, gateway/config.py).
LOOPBACK_SOURCES: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# What gateway.media answers with (G.711 only; telephone-event is added whenever offered).
SUPPORTED_CODECS = ("PCMU", "PCMA", "G722")  # gateway/media/codecs.py
WILDCARD_HOSTS = ("0.0.0.0", "::")


class SipTcpSection(ConnectionCapsSection):
    """What one TCP peer may cost (sip.tcp); the total is also kept below the process's descriptor limit."""

    max_connections: int = Field(500, ge=1)
    max_connections_per_source: int = Field(50, ge=1)
    idle_timeout_s: float = Field(60.0, gt=0)  # no byte at all for this long: close
    read_timeout_s: float = Field(10.0, gt=0)  # a message begun must arrive whole within this
    max_unsent_bytes: int = Field(262144, ge=4096)  # queued for a peer that does not read: over it, close


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
        if self.advertised_host is None and self.listen.host in WILDCARD_HOSTS:
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
