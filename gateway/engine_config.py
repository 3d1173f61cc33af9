"""The `engine` block of the config: which engine speaks, where it runs, and how calls are admitted.

It owns the engine's sub-sections (worker processes, remote workers, admission, the espeak and
instant settings checked here; cosyvoice2's settings are checked by the engine itself through
engines/registry.py) and turns them into `WorkerPlan`s, the worker processes the gateway supervises
(gateway/worker_supervisor.py). gateway/config.py puts this block into the whole file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from engines.base import GraphsState
from gateway.config_errors import FieldProblem
from gateway.config_types import HttpCapsSection, Section


class _EngineWithVoices(Section):
    """An engine block whose voices are listed in the config: the default must be one of them."""

    @model_validator(mode="after")
    def _default_is_a_voice(self) -> _EngineWithVoices:
        voices, default = self.voices, self.default_voice
        if default not in voices:
            raise FieldProblem("default_voice", f"{default!r} is not one of voices ({', '.join(voices)})")
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
    # what its health says of compiled graphs: it compiles nothing, but stands in for a GPU engine in tests
    graphs: GraphsState = "compiled"


class EngineWorkerSection(HttpCapsSection):
    """Engine worker processes the gateway starts (python -m engine_service), one engine each; the HTTP caps
    (max_connections, max_connections_per_source, idle_timeout_s, header_timeout_s) are each worker's port's."""

    listen_host: str = "127.0.0.1"  # where supervised workers listen; loopback unless other gateways use them
    slots: int | None = Field(None, ge=1)  # streams per worker; None: cosyvoice2's max_batch, else 64
    dead_after_ms: int = Field(1000, ge=100, le=60000)  # a worker silent this long is dead: its calls end
    # One start of a supervised worker (model load, compile, warm-up on a GPU) may take this long; a worker not
    # listening by then is killed and started again (docs/ARCHITECTURE.md, "Worker supervision").
    start_timeout_s: float = Field(900.0, gt=0)
    # Supervised worker i listens on port + i: its gateway link, /healthz, /metrics (so Prometheus can be
    # pointed at it) and the speech API when tts_api is set. None: a free port, and then no speech API is
    # served, since its clients must know where to connect. A restarted worker comes back on its port.
    port: int | None = Field(None, ge=1, le=65535)
    # Connections past the caps kept for the gateways' links: admitted on probation, kept only if their request
    # head carries the engine token, so a flood of idle connections never locks a gateway out.
    link_reserve: int = Field(8, ge=1, le=1024)
    # The engine token the supervised workers accept. Empty: a fresh secret per start, so only this gateway can
    # use them. Set (with `port`): the other gateway processes of the host can share them, each with
    # engine.remote.urls naming these ports and this token (README, "Several gateway processes on one host").
    token: str = ""

    def listener_options(self) -> dict[str, Any]:
        """The worker's --http-limits (its listener's caps)."""
        return self.model_dump(include={"max_connections", "max_connections_per_source", "idle_timeout_s",
                                        "header_timeout_s", "link_reserve"})

    @model_validator(mode="before")
    @classmethod
    def _api_port_is_port(cls, data: Any) -> Any:
        # The key's old name, refused with the new one named: the port serves more than the API.
        if isinstance(data, dict) and "api_port" in data:
            raise FieldProblem("api_port", "unknown field; the worker's one port is engine.worker.port")
        return data


class EngineRemoteSection(Section):
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


class EngineAdmissionSection(Section):
    # Refuse a call (503) when the best worker's expected first audio is later than this; None: no bound.
    max_first_audio_ms: float | None = Field(None, gt=0)


@dataclass(frozen=True)
class WorkerPlan:
    """One engine worker process the gateway supervises."""

    name: str
    engine: str
    settings: dict[str, Any]
    device: str | None  # the worker's --device: cuda:0 for a GPU worker, which sees only its GPU (`gpu`)
    slots: int | None
    listen_host: str
    listen_port: int = 0  # 0: any free port (the gateway learns it from the worker); else the same at each restart
    tts_api: dict[str, Any] | None = None  # the speech API's block, checked by the worker at its start
    log_level: str = "info"  # the gateway's logging.level when it started (a SIGHUP does not reach workers)
    http_limits: dict[str, Any] | None = None  # engine.worker's HTTP caps (its --http-limits)
    prompt_texts: tuple[str, ...] = ()  # the config's prompts, prepared at the worker's start (SpeechEngine.prepare)
    # The host's GPU (an entry of engine.cosyvoice2.devices) this worker owns: the supervisor starts it with
    # CUDA_VISIBLE_DEVICES naming that GPU alone, so every stream, graph and generator of the process is on it.
    gpu: int | None = None
    start_timeout_s: float = 900.0  # engine.worker.start_timeout_s


class EngineSection(Section):
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
                raise FieldProblem("cosyvoice2.devices", "expected a list of CUDA device numbers, e.g. [0, 1]")
            if len(set(devices)) != len(devices):
                raise FieldProblem("cosyvoice2.devices", "a device is listed twice")
            if self.workers is not None and self.workers != len(devices):
                raise FieldProblem("workers", f"{self.workers} workers but {len(devices)} cosyvoice2.devices; "
                                               "cosyvoice2 runs one worker per device")
        port, count = self.worker.port, len(self.worker_plans())
        if port is not None and port + count - 1 > 65535:
            raise FieldProblem("worker.port", f"{count} workers listen on {port} to {port + count - 1}; "
                                              "the last must be at most 65535")
        if self.worker.token and count and port is None:
            raise FieldProblem("worker.token", "other gateways can share the supervised workers only at known "
                                               "ports: set engine.worker.port too")
        if self.name == "remote" and not self.remote.urls:
            raise FieldProblem("remote.urls", "engine remote needs at least one worker URL")
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
            gpus: list[int | None] = list(devices)
        else:
            count = self.workers
            if count is None:
                count = 1 if self.name == "cosyvoice2" and not self.remote.urls else 0
            gpus = [None] * count
        port = self.worker.port
        return [WorkerPlan(name=f"{self.name}-{index if gpu is None else f'cuda:{gpu}'}", engine=self.name,
                           settings=self.settings(), device=None if gpu is None else "cuda:0", gpu=gpu,
                           slots=self.worker.slots, listen_host=self.worker.listen_host,
                           listen_port=0 if port is None else port + index,
                           start_timeout_s=self.worker.start_timeout_s,
                           http_limits=self.worker.listener_options())
                for index, gpu in enumerate(gpus)]

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
