"""The gateway's configuration: one YAML file validated at start into typed, frozen objects.

Operators write keys named after what they think of (sip, trunks, media, engine, voices, prompts,
routes, http, logging, shutdown, mrcp); every section has defaults that work on loopback, and with no file
at all `EMBEDDED_DEFAULT` applies (SIP on 127.0.0.1:5060 UDP+TCP, HTTP on 127.0.0.1:8080, the espeak
engine, two demo routes). A wrong key or value raises `ConfigError` whose message starts with the key
path, e.g. `routes[2].voice: unknown field` or `sip.listen: expected HOST:PORT`.

Security default: `trunks` lists who may send INVITEs. With no trunks only loopback sources
(127.0.0.0/8, ::1) are accepted; a PBX must be listed before it can reach the gateway.

This module owns the top-level schema (`GatewayConfig`: the checks across sections and what the rest of the
gateway asks of the config) and the loader; the other sections' schemas live in gateway/config_sections.py,
the engine block in gateway/engine_config.py, the value types (HOST:PORT, CIDR, port range) in gateway/config_types.py,
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
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import Field, ValidationError, model_validator

from engines.ssml import Segment, Speech, SsmlError, is_ssml, parse_ssml
from gateway.config_errors import ConfigError, describe
from gateway.config_sections import (
    LOOPBACK_SOURCES,
    WILDCARD_HOSTS,
    HttpSection,
    LoggingSection,
    MediaSection,
    MrcpSection,
    PromptCacheSection,
    PromptSection,
    Route,
    ShutdownSection,
    SipSection,
    Trunk,
)
from gateway.config_types import IPNetwork, Section
from gateway.engine_config import EngineSection, WorkerPlan

if TYPE_CHECKING:
    from gateway.routing import PromptRouter


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
        if host not in WILDCARD_HOSTS:
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
