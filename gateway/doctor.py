"""`cosyvoice-gateway doctor`: is this host ready to serve with this config? One line per check, what to do when
one fails.

Checks, in order: the config (load_config, every key), the ports it listens on (SIP, HTTP, the engine workers'
fixed ports: free to bind now), and for cosyvoice2: the NVIDIA driver and CUDA, torch's CUDA build, each GPU's
free memory against `max_batch`, the model directory (every file, each state dict loaded strictly), the voices,
and the compiler-cache directory (writable). A check that does not apply says so (SKIP) rather than passing.
Read-only apart from a probe file in the cache directory; it starts no engine and answers no call.
"""

from __future__ import annotations

import errno
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gateway.config import ConfigError, GatewayConfig, load_config

DEFAULT_CACHE_DIR = Path("/var/cache/cosyvoice-gateway")  # systemd/cosyvoice-gateway.service's CacheDirectory
# GPU memory one cosyvoice2 worker needs: weights and graphs, plus each batch slot's KV cache and flow context
# (53 GB measured at max_batch 128 on an H100, bf16, docs/PERF_NOTES.md "Under load"). A rough bound, to
# catch a max_batch that cannot fit, not to size a GPU to the gigabyte.
GPU_BASE_GB = 2.0
GPU_GB_PER_SLOT = 0.4


@dataclass(frozen=True)
class Check:
    name: str
    status: Literal["ok", "fail", "skip"]
    detail: str
    fix: str = ""  # what to do, for a failed check

    def line(self) -> str:
        text = f"{self.status.upper():<5} {self.name:<22}  {self.detail}"  # two spaces even after a long name
        return f"{text}\n      -> {self.fix}" if self.status == "fail" and self.fix else text


def run(config_path: str | None, overrides: Mapping[str, object] | None = None,
        cache_dir: Path | None = None) -> list[Check]:
    """Every check for the config at `config_path` (None: the embedded default) with serve's --set `overrides`."""
    try:
        config = load_config(config_path, overrides)
    except ConfigError as exc:
        return [Check("config", "fail", f"{config_path or 'built-in default'}: {exc}",
                      "fix the key named (the README's Configuration section lists them), then run doctor again")]
    except OSError as exc:
        return [Check("config", "fail", f"{config_path}: {exc.strerror or exc}", "give the path of a readable file")]
    engine = config.engine.name
    checks = [Check("config", "ok", f"{config_path or 'built-in default'}: engine {engine}, "
                                    f"{len(config.engine.worker_plans())} supervised worker(s)")]
    checks += list(_ports(config))
    if engine != "cosyvoice2":
        checks += [Check("gpu", "skip", f"engine {engine} runs on CPU"),
                   Check("model directory", "skip", f"engine {engine} has none"),
                   Check("voices", "skip", f"engine {engine}'s voices are the config's, checked with it")]
        if cache_dir is None:
            checks.append(Check("compiler cache", "skip", f"engine {engine} compiles nothing"))
            return checks
    else:
        checks += _cosyvoice2(config)
    checks.append(_cache(cache_dir or DEFAULT_CACHE_DIR))
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(check.status == "fail" for check in checks) else 0


# -- ports ---------------------------------------------------------------------------------------
def _ports(config: GatewayConfig) -> Iterator[Check]:
    sip = config.sip.listen
    wanted = [(f"sip.listen {transport}", sip.host, sip.port,
               socket.SOCK_DGRAM if transport == "udp" else socket.SOCK_STREAM, "sip.listen")
              for transport in config.sip.transports]
    wanted.append(("http.listen", config.http.listen.host, config.http.listen.port, socket.SOCK_STREAM,
                   "http.listen"))
    wanted += [(f"worker port ({plan.name})", plan.listen_host, plan.listen_port, socket.SOCK_STREAM,
                "engine.worker.port") for plan in config.engine.worker_plans() if plan.listen_port]
    for name, host, port, kind, key in wanted:
        problem = _bind_problem(host, port, kind)
        where = f"{host}:{port}/{'udp' if kind == socket.SOCK_DGRAM else 'tcp'}"
        if problem is None:
            yield Check(name, "ok", f"{where} free")
        else:
            yield Check(name, "fail", f"{where} {problem}",
                        f"`ss -lnp 'sport = :{port}'` shows who holds it: stop that (a gateway already running: "
                        f"systemctl stop cosyvoice-gateway) or change {key}")


def _bind_problem(host: str, port: int, kind: int) -> str | None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, kind) as probe:
        if kind == socket.SOCK_STREAM:
            # what a listener sets, so a port held only by TIME_WAIT connections counts as free
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return "is in use by another process"
            if exc.errno == errno.EACCES:
                return "needs privileges to bind (a port below 1024)"
            return f"cannot be bound ({exc.strerror})"
    return None


# -- cosyvoice2: GPU, model, voices --------------------------------------------------------------
def _cosyvoice2(config: GatewayConfig) -> list[Check]:
    from engines.cosyvoice2.settings import CosyVoice2Settings

    settings = CosyVoice2Settings.from_config(config.engine.settings())  # load_config has validated it
    gpus = config.engine.cosyvoice2.get("devices") or [0]
    checks = _gpu(settings.device, settings.max_batch, gpus)
    checks.append(_guarded("model directory", lambda: _model(settings.model_dir),
                           "the file named is missing, truncated or from another model: copy the model directory "
                           "again (CosyVoice2-0.5B, official layout) and point engine.cosyvoice2.model_dir at it"))
    if checks[-1].status == "fail":
        return [*checks, Check("voices", "skip", "the model directory failed: its voices cannot be read")]
    checks.append(_guarded("voices", lambda: _voices(settings.model_dir, settings.voices_dir),
                           "re-add the voice (cosyvoice-gateway voice add --replace) or remove it "
                           "(cosyvoice-gateway voice remove NAME)"))
    return checks


def _guarded(name: str, check: Callable[[], Check], fix: str) -> Check:
    """The check's own result, or a failure naming what it raised (a missing file, keys that do not match)."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 -- any failure to load is the finding itself, reported with its cause
        return Check(name, "fail", f"{type(exc).__name__}: {exc}", fix)


def _model(model_dir: Path) -> Check:
    from engines.cosyvoice2.model_check import check_model_dir

    return Check("model directory", "ok", f"{model_dir}: {check_model_dir(model_dir)}")


def _voices(model_dir: Path, voices_dir: Path | None) -> Check:
    from engines.cosyvoice2.model_check import voice_problems

    count, problems = voice_problems(model_dir, voices_dir)
    if problems:
        return Check("voices", "fail", f"{len(problems)} of {count} cannot be loaded: {'; '.join(problems)}",
                     "re-add the voice (cosyvoice-gateway voice add --replace) or remove it "
                     "(cosyvoice-gateway voice remove NAME): the engine refuses to start with a broken one")
    if count == 0:
        return Check("voices", "fail", f"no voice in {model_dir} (spk2info.pt or voices/)",
                     "add one: cosyvoice-gateway voice add NAME --wav PROMPT.wav --text '...' --model-dir DIR")
    return Check("voices", "ok", f"{count} voice(s) load")


def _gpu(device: str, max_batch: int, gpus: list[int]) -> list[Check]:
    if device == "cpu":
        return [Check("gpu", "skip", "engine.cosyvoice2.device is cpu")]
    if shutil.which("nvidia-smi") is None:
        if device == "auto":
            return [Check("gpu", "skip", "no NVIDIA driver (nvidia-smi not found): device auto runs on CPU, "
                                         "far below real time for more than a call or two")]
        return [Check("gpu", "fail", f"engine.cosyvoice2.device is {device} but nvidia-smi is not found",
                      "install the NVIDIA driver (apt install nvidia-driver; reboot) or set device: cpu")]
    checks = [_driver(), _torch_cuda()]
    need = GPU_BASE_GB + GPU_GB_PER_SLOT * max_batch
    try:
        free = _gpu_free_gb()
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        return [*checks, Check("gpu memory", "fail", f"nvidia-smi could not report memory ({exc})",
                               "check the driver: nvidia-smi must list the GPUs")]
    for gpu in gpus:
        if gpu not in free:
            checks.append(Check(f"gpu {gpu} memory", "fail", f"GPU {gpu} is not on this host ({len(free)} found)",
                                "list only the host's GPUs in engine.cosyvoice2.devices (nvidia-smi -L)"))
        elif free[gpu] < need:
            fits = max(0, int((free[gpu] - GPU_BASE_GB) / GPU_GB_PER_SLOT))
            checks.append(Check(f"gpu {gpu} memory", "fail",
                                f"{free[gpu]:.1f} GB free, max_batch {max_batch} needs about {need:.0f} GB",
                                f"lower engine.cosyvoice2.max_batch to {fits} or free the GPU (nvidia-smi shows "
                                "what holds it)"))
        else:
            checks.append(Check(f"gpu {gpu} memory", "ok",
                                f"{free[gpu]:.1f} GB free, max_batch {max_batch} needs about {need:.0f} GB"))
    return checks


def _nvidia_smi(*args: str) -> str:
    return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, check=True, timeout=30).stdout


def _driver() -> Check:
    try:
        header = _nvidia_smi()
        driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader").split()[0]
    except (OSError, subprocess.SubprocessError, IndexError) as exc:
        return Check("nvidia driver", "fail", f"nvidia-smi failed ({exc})",
                     "the driver is not loaded: reinstall it or reboot after an upgrade")
    cuda = cuda_version_of(header)
    return Check("nvidia driver", "ok", f"driver {driver}, supports CUDA up to {cuda or 'unknown'}")


def cuda_version_of(nvidia_smi_header: str) -> str | None:
    """'12.4' from nvidia-smi's banner ('CUDA Version: 12.4'); the newest CUDA the driver runs."""
    _, found, rest = nvidia_smi_header.partition("CUDA Version:")
    return rest.split()[0] if found and rest.split() else None


def _torch_cuda() -> Check:
    fix = "install torch's CUDA build for this driver: scripts/install_gpu_host.sh (it maps the driver to the wheel)"
    try:
        import torch
    except ImportError:
        return Check("torch", "fail", "torch is not installed", fix)
    if torch.version.cuda is None:
        return Check("torch", "fail", f"torch {torch.__version__} is a CPU build", fix)
    if not torch.cuda.is_available():
        return Check("torch", "fail", f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: the "
                                      "driver is older than this CUDA build, or CUDA_VISIBLE_DEVICES hides them", fix)
    return Check("torch", "ok", f"torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                f"{torch.cuda.device_count()} GPU(s) visible")


def _gpu_free_gb() -> dict[int, float]:
    rows = _nvidia_smi("--query-gpu=index,memory.total,memory.used", "--format=csv,noheader,nounits")
    free = {}
    for row in rows.strip().splitlines():
        index, total, used = (field.strip() for field in row.split(","))
        free[int(index)] = (float(total) - float(used)) / 1024  # MiB -> GiB
    return free


# -- the compiler cache --------------------------------------------------------------------------
def _cache(cache_dir: Path) -> Check:
    fix = (f"create it for the service's user: install -d -o cosyvoice -g cosyvoice {cache_dir} (the systemd unit's "
           "CacheDirectory does this), or pass --cache-dir")
    if not cache_dir.is_dir():
        return Check("compiler cache", "fail", f"{cache_dir} does not exist", fix)
    try:
        with tempfile.NamedTemporaryFile(dir=cache_dir, prefix=".doctor-"):
            pass
    except OSError as exc:
        return Check("compiler cache", "fail", f"{cache_dir} is not writable ({exc.strerror})", fix)
    return Check("compiler cache", "ok", f"{cache_dir} writable")
