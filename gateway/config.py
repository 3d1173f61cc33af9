"""The gateway's configuration: one YAML file validated at start into typed, frozen objects.

Operators write keys named after what they think of (sip, trunks, media, engine, voices, prompts,
routes, http, logging, shutdown); every section has defaults that work on loopback, and with no file
at all `EMBEDDED_DEFAULT` applies (SIP on 127.0.0.1:5060 UDP+TCP, HTTP on 127.0.0.1:8080, the espeak
engine, two demo routes). A wrong key or value raises `ConfigError` whose message starts with the key
path, e.g. `routes[2].voice: unknown field` or `sip.listen: expected HOST:PORT`.

Security default: `trunks` lists who may send INVITEs. With no trunks only loopback sources
(127.0.0.0/8, ::1) are accepted; a PBX must be listed before it can reach the gateway.

This module owns parsing and validation only. The SIP and media packages take their own settings
objects; `sip_settings()` / `media_settings()` build those, and `prompt_resolver()` builds the
route lookup (gateway/routing.py), all imported lazily so the config can be loaded and checked
without them. Nothing here reads environment variables.
"""

from __future__ import annotations

import dataclasses

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)

if TYPE_CHECKING:
    from gateway.routing import PromptRouter

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
LOOPBACK_SOURCES: tuple[IPNetwork, ...] = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))
# What gateway.media answers with (G.711 only; telephone-event is added whenever offered).
SUPPORTED_CODECS = ("PCMU", "PCMA")
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


class ConfigError(ValueError):
    """The configuration cannot be used; `errors` holds one 'key.path: problem' line per mistake."""

    def __init__(self, errors: Sequence[str]) -> None:
        self.errors = list(errors)
        super().__init__("; ".join(self.errors))


class _FieldProblem(ValueError):
    """Raised by cross-field checks so the message names the field, not only its section."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"@{field}: {message}")


# -- value types ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class HostPort:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def _host_port(value: Any) -> HostPort:
    if isinstance(value, HostPort):
        return value
    if not isinstance(value, str):
        raise ValueError("expected HOST:PORT")
    if value.startswith("["):  # [IPv6]:port
        host, _, port = value[1:].partition("]:")
    else:
        host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 <= int(port) <= 65535 or (":" in host and not value.startswith("[")):
        raise ValueError("expected HOST:PORT (e.g. 0.0.0.0:5060 or [::]:5060)")
    return HostPort(host, int(port))


def _network(value: Any) -> IPNetwork:
    try:
        return ipaddress.ip_network(str(value), strict=False)
    except ValueError:
        raise ValueError(f"expected an IP address or CIDR (e.g. 192.0.2.10 or 10.0.0.0/24), got {value!r}") from None


def _port_range(value: Any) -> tuple[int, int]:
    low, _, high = str(value).partition("-")
    if not (low.strip().isdigit() and high.strip().isdigit()):
        raise ValueError("expected LOW-HIGH (e.g. 20000-30000)")
    low_port, high_port = int(low), int(high)
    if not 1024 <= low_port < high_port <= 65535:
        raise ValueError("expected 1024 <= LOW < HIGH <= 65535")
    if high_port - low_port < 3:
        raise ValueError("range must hold at least one RTP/RTCP port pair")
    return low_port, high_port


ListenAddress = Annotated[HostPort, PlainValidator(_host_port)]
Network = Annotated[IPNetwork, PlainValidator(_network)]
PortRange = Annotated[tuple[int, int], PlainValidator(_port_range)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# -- sections ------------------------------------------------------------------------------------
class SipTcpSection(_Section):
    """What one TCP peer may cost (sip.tcp); the total is also kept below the process's descriptor limit."""

    max_connections: int = Field(500, ge=1)
    max_connections_per_source: int = Field(50, ge=1)
    idle_timeout_s: float = Field(60.0, gt=0)  # no byte at all for this long: close
    read_timeout_s: float = Field(10.0, gt=0)  # a message begun must arrive whole within this

    @model_validator(mode="after")
    def _per_source_within_total(self) -> SipTcpSection:
        if self.max_connections_per_source > self.max_connections:
            raise _FieldProblem("max_connections_per_source", "must not exceed max_connections")
        return self


class SipFloodSection(_Section):
    """Per-source rate limit before parsing (sip.flood); over it: a few cheap 503s, the rest dropped."""

    max_requests_per_s_per_source: float = Field(100.0, gt=0)  # bursts of twice this pass


class SipSection(_Section):
    listen: ListenAddress = HostPort("127.0.0.1", 5060)
    transports: tuple[Literal["udp", "tcp"], ...] = ("udp", "tcp")
    # The address put in Contact, Via and SDP; required when listening on all interfaces.
    advertised_host: str | None = None
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
            raise _FieldProblem("advertised_host", f"required when listen binds all interfaces ({self.listen})")
        if self.t1_ms > self.t2_ms:
            raise _FieldProblem("t1_ms", "must not exceed t2_ms")
        return self

    @property
    def public_host(self) -> str:
        return self.advertised_host or self.listen.host


class Trunk(_Section):
    name: str = Field(min_length=1)
    allow: tuple[Network, ...]

    @field_validator("allow")
    @classmethod
    def _not_empty(cls, value: tuple[IPNetwork, ...]) -> tuple[IPNetwork, ...]:
        if not value:
            raise ValueError("list at least one address or CIDR the trunk sends from")
        return value


class MediaSection(_Section):
    rtp_port_range: PortRange = (20000, 30000)
    codecs: tuple[str, ...] = SUPPORTED_CODECS  # in order of preference
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
            raise _FieldProblem("initial_playout_delay_ms", "must not exceed max_playout_delay_ms")
        return self


class _EngineWithVoices(_Section):
    """An engine block whose voices are listed in the config: the default must be one of them."""

    @model_validator(mode="after")
    def _default_is_a_voice(self) -> _EngineWithVoices:
        voices, default = self.voices, self.default_voice
        if default not in voices:
            raise _FieldProblem("default_voice", f"{default!r} is not one of voices ({', '.join(voices)})")
        return self


class EspeakSettings(_EngineWithVoices):
    voices: dict[str, str] = Field(default_factory=lambda: {"en": "en-us", "zh": "cmn"}, min_length=1)
    default_voice: str = "en"
    rate_wpm: int = Field(175, ge=80, le=450)


class InstantSettings(_EngineWithVoices):
    voices: tuple[str, ...] = Field(("en", "zh"), min_length=1)
    default_voice: str = "en"
    ms_per_char: float = Field(60.0, gt=0)
    min_duration_s: float = Field(0.5, ge=0)
    max_duration_s: float = Field(30.0, gt=0)
    chunk_ms: int = Field(200, ge=10, le=5000)
    first_chunk_delay_ms: float = Field(0.0, ge=0)
    realtime: bool = False  # deliver audio at the pace of a streaming model (a stream holds its slot as long)


class EngineWorkerSection(_Section):
    """Engine worker processes the gateway starts (python -m engine_service), one engine each."""

    listen_host: str = "127.0.0.1"  # where supervised workers listen; loopback unless other gateways use them
    slots: int | None = Field(None, ge=1)  # streams per worker; None: cosyvoice2's max_batch, else 64
    dead_after_ms: int = Field(1000, ge=100, le=60000)  # a worker silent this long is dead: its calls end
    start_timeout_s: float = Field(900.0, gt=0)  # model load, compile and warm-up of a GPU worker
    # The speech API (tts_api block) is served by each supervised worker on this port + its index;
    # None: on a free port (the API is then for the gateway's links only, so it is not served at all).
    api_port: int | None = Field(None, ge=1, le=65535)


class EngineRemoteSection(_Section):
    """Workers on other hosts (python -m engine_service --listen ... --token-file ...), shared by gateways."""

    urls: tuple[str, ...] = ()  # ws://host:port/v1/engine/stream
    token: str = ""  # the bearer token those workers were started with

    @field_validator("urls")
    @classmethod
    def _websocket_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for url in value:
            if not url.startswith(("ws://", "wss://")):
                raise ValueError(f"{url!r}: expected ws://HOST:PORT/v1/engine/stream (or wss://)")
        return value


class EngineAdmissionSection(_Section):
    # Refuse a call (503) when the best worker's expected first audio is later than this; None: no bound.
    max_first_audio_ms: float | None = Field(None, gt=0)


@dataclass(frozen=True)
class WorkerPlan:
    """One engine worker process the gateway supervises."""

    name: str
    engine: str
    settings: dict[str, Any]
    device: str | None
    slots: int | None
    listen_host: str
    listen_port: int = 0  # 0: any free port (the gateway learns it from the worker)
    tts_api: dict[str, Any] | None = None  # the speech API's block, checked by the worker at its start


class EngineSection(_Section):
    name: str = "espeak"
    # Worker processes for this engine; 0: the engine runs inside the gateway. None (auto): cosyvoice2 one per
    # entry of cosyvoice2.devices (one with no devices listed, none when only remote workers are configured);
    # espeak and instant in the gateway process.
    workers: int | None = Field(None, ge=0, le=64)
    worker: EngineWorkerSection = EngineWorkerSection()
    remote: EngineRemoteSection = EngineRemoteSection()
    admission: EngineAdmissionSection = EngineAdmissionSection()
    espeak: EspeakSettings = EspeakSettings()
    instant: InstantSettings = InstantSettings()
    # Passed to the engine as keyword settings; the engine validates its own keys at start. `devices` (a list
    # of CUDA device numbers) is the gateway's: one worker process per device.
    cosyvoice2: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _worker_counts(self) -> EngineSection:
        devices = self.cosyvoice2.get("devices")
        if devices is not None:
            if not isinstance(devices, list) or not devices or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices):
                raise _FieldProblem("cosyvoice2.devices", "expected a list of CUDA device numbers, e.g. [0, 1]")
            if len(set(devices)) != len(devices):
                raise _FieldProblem("cosyvoice2.devices", "a device is listed twice")
            if self.workers is not None and self.workers != len(devices):
                raise _FieldProblem("workers", f"{self.workers} workers but {len(devices)} cosyvoice2.devices; "
                                               "cosyvoice2 runs one worker per device")
        if self.name == "remote" and not self.remote.urls:
            raise _FieldProblem("remote.urls", "engine remote needs at least one worker URL")
        if self.name == "cosyvoice2":
            from engines.registry import check_settings

            try:
                check_settings(self.name, self.settings())
            except ValueError as exc:  # its message already names the key: engine.cosyvoice2.<key>: ...
                raise ValueError("@@" + str(exc)) from None
        return self

    @field_validator("name")
    @classmethod
    def _registered(cls, value: str) -> str:
        from engines.registry import ENGINES

        if value not in ENGINES:
            raise ValueError(f"unknown engine {value!r}; choose one of {', '.join(sorted(ENGINES))}")
        return value

    def settings(self) -> dict[str, Any]:
        """The engine's own keyword settings (the gateway's `devices` taken out)."""
        if self.name == "remote":
            return {"urls": self.remote.urls, "token": self.remote.token}
        block = getattr(self, self.name)
        if isinstance(block, dict):
            return {key: value for key, value in block.items() if key != "devices"}
        return block.model_dump()

    def worker_plans(self) -> list[WorkerPlan]:
        """The worker processes to supervise (empty: in-process engine, or remote workers only)."""
        if self.name == "remote":
            return []
        devices = self.cosyvoice2.get("devices") if self.name == "cosyvoice2" else None
        if devices is not None:
            targets: list[str | None] = [f"cuda:{device}" for device in devices]
        else:
            count = self.workers
            if count is None:
                count = 1 if self.name == "cosyvoice2" and not self.remote.urls else 0
            targets = [None] * count
        return [WorkerPlan(name=f"{self.name}-{target or index}", engine=self.name, settings=self.settings(),
                           device=target, slots=self.worker.slots, listen_host=self.worker.listen_host)
                for index, target in enumerate(targets)]

    @property
    def uses_workers(self) -> bool:
        return bool(self.worker_plans() or self.remote.urls)

    def configured_voices(self) -> tuple[str, ...] | None:
        """The engine's voice names when the config defines them; None when the engine discovers them."""
        block = getattr(self, self.name, None)
        return tuple(block.voices) if isinstance(block, EspeakSettings | InstantSettings) else None

    @property
    def default_voice(self) -> str:
        block = getattr(self, self.name)
        if isinstance(block, EngineRemoteSection):
            return "default"
        if isinstance(block, dict):
            return str(block.get("default_voice", "default"))
        return block.default_voice


class PromptSection(_Section):
    text: str = Field(min_length=1)
    voice: str | None = None  # a voice or alias; the engine's default when absent
    barge_in: bool = False  # a key press (DTMF) stops the prompt


class Route(_Section):
    """Dialed user part -> what to say. `match`: exact ("1000"), prefix ("49301*") or "*" (any)."""

    match: str = Field(min_length=1)
    prompt: str | None = None
    text: str | None = Field(None, min_length=1)
    voice: str | None = None
    after: Literal["hangup", "stay"] = "hangup"
    barge_in: bool = False

    @field_validator("match")
    @classmethod
    def _pattern(cls, value: str) -> str:
        if any(ch.isspace() for ch in value) or "*" in value[:-1]:
            raise ValueError("expected a number, a prefix ending in * (e.g. 4930*), or *")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> Route:
        if (self.prompt is None) == (self.text is None):
            raise _FieldProblem("prompt", "give either prompt (a name from prompts) or text")
        if self.voice is not None and self.prompt is not None:
            raise _FieldProblem("voice", "only with text; a named prompt carries its own voice")
        return self

    @property
    def prefix(self) -> str | None:
        return self.match[:-1] if self.match.endswith("*") else None


class HttpSection(_Section):
    listen: ListenAddress = HostPort("127.0.0.1", 8080)


class LoggingSection(_Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    json_: bool = Field(True, alias="json")
    file: str | None = Field(None, min_length=1)  # append here instead of stderr; SIGHUP reopens it (logrotate)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class ShutdownSection(_Section):
    drain_timeout_s: float = Field(30.0, ge=0)


# -- the whole file ------------------------------------------------------------------------------
class GatewayConfig(_Section):
    sip: SipSection = SipSection()
    trunks: tuple[Trunk, ...] = ()
    media: MediaSection = MediaSection()
    engine: EngineSection = EngineSection()
    voices: dict[str, str] = Field(default_factory=dict)  # alias -> engine voice
    prompts: dict[str, PromptSection] = Field(default_factory=dict)
    routes: tuple[Route, ...] = ()
    http: HttpSection = HttpSection()
    logging: LoggingSection = LoggingSection()
    shutdown: ShutdownSection = ShutdownSection()
    # The speech API (HTTP, WebSocket, jambonz) the engine workers serve; its keys are checked by the
    # worker at start (engine_service/api/settings.py), a mistake there stops the start with exit 2.
    tts_api: dict[str, Any] | None = None

    def worker_plans(self) -> list[WorkerPlan]:
        """The engine's worker processes, each also serving the speech API when `tts_api` and a port are set."""
        plans = self.engine.worker_plans()
        port = self.engine.worker.api_port
        if self.tts_api is None or port is None:
            return plans
        return [dataclasses.replace(plan, tts_api=self.tts_api, listen_port=port + index)
                for index, plan in enumerate(plans)]

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
        if problems:
            raise ValueError("@@" + "\n".join(problems))
        return self

    # -- what the rest of the gateway asks ---------------------------------------------------------
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

    def sip_settings(self):
        from gateway.sip.transport import StreamLimits
        from gateway.sip.uas import SipSettings

        sip = self.sip
        return SipSettings(listen_host=sip.listen.host, listen_port=sip.listen.port, transports=sip.transports,
                           allowed_sources=self.allowed_sources, max_calls=sip.max_calls,
                           retry_after_s=sip.retry_after_s, t1=sip.t1_ms / 1000, t2=sip.t2_ms / 1000,
                           t4=sip.t4_ms / 1000, user_agent=sip.user_agent, advertised_host=sip.public_host,
                           stream_limits=StreamLimits(sip.tcp.max_connections, sip.tcp.max_connections_per_source,
                                                      sip.tcp.idle_timeout_s, sip.tcp.read_timeout_s,
                                                      sip.max_message_bytes),
                           max_requests_per_s_per_source=sip.flood.max_requests_per_s_per_source)

    def media_settings(self):
        from gateway.media.call_media import MediaSettings

        media = self.media
        return MediaSettings(advertised_host=self.sip.public_host, rtp_port_min=media.rtp_port_range[0],
                             rtp_port_max=media.rtp_port_range[1], codecs=media.codecs,
                             initial_playout_delay_ms=media.initial_playout_delay_ms,
                             max_playout_delay_ms=media.max_playout_delay_ms, rtcp_interval_s=media.rtcp_interval_s,
                             rtp_latching=media.rtp_latching, dtmf_max_per_second=media.dtmf_max_per_second,
                             inactivity_timeout_s=media.inactivity_timeout_s)

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
        raise ConfigError(_describe(exc)) from None


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
    if data is None:
        return {}
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


def _key_path(location: Sequence[str | int]) -> str:
    path = ""
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path or "(top level)"


def _describe(exc: ValidationError) -> list[str]:
    lines: list[str] = []
    for error in exc.errors(include_url=False):
        location = [part for part in error["loc"] if part not in ("function-after", "function-plain")]
        message = error["msg"].removeprefix("Value error, ")
        if message.startswith("@@"):  # whole-config reference checks: already 'key: problem' lines
            lines += message[2:].split("\n")
            continue
        if message.startswith("@"):  # a cross-field check naming its field
            field, _, message = message[1:].partition(": ")
            location.append(field)
        elif error["type"] == "extra_forbidden":
            message = "unknown field"
        elif error["type"] == "missing":
            message = "required field is missing"
        lines.append(f"{_key_path(location)}: {message}")
    return lines
