"""The command line and environment a supervised engine worker is started with: what the operator configured
reaches the worker, in arguments `python -m engine_service` accepts, and a GPU worker sees only its GPU."""

from __future__ import annotations

import json

import pytest

from engine_service.__main__ import _parser
from gateway.config import load_config
from gateway.worker_supervisor import WorkerFailed, worker_command, worker_env


def _worker_args(plan):
    command = worker_command(plan)
    assert command[1:3] == ["-m", "engine_service"]
    return _parser().parse_args(command[3:])


@pytest.mark.parametrize("level", ["debug", "info", "warning", "error"])
def test_a_worker_is_started_at_the_gateways_log_level(level):
    plan, = load_config(None, {"engine.workers": 1, "logging.level": level}).worker_plans()
    assert _worker_args(plan).log_level == level


def test_workers_with_a_fixed_port_listen_on_port_plus_index():
    first, second = load_config(None, {"engine.workers": 2, "engine.worker.port": 7100}).worker_plans()
    assert (_worker_args(first).listen, _worker_args(second).listen) == ("127.0.0.1:7100", "127.0.0.1:7101")


def test_workers_are_told_the_configured_prompts_to_prepare():
    config = load_config(None, {
        "engine.workers": 1,
        "prompts": {"welcome": {"text": "Welcome to Acme. 欢迎。"}, "bye": {"text": "Goodbye."}},
        "routes": [{"match": "1000", "prompt": "welcome"}, {"match": "2000", "text": "Goodbye."},
                   {"match": "*", "text": "Please hold."}]})
    plan, = config.worker_plans()
    assert json.loads(_worker_args(plan).prepare_texts) == ["Welcome to Acme. 欢迎。", "Goodbye.", "Please hold."]
    bare, = load_config(None, {"engine.workers": 1, "prompts": {}, "routes": []}).worker_plans()
    assert _worker_args(bare).prepare_texts is None  # nothing configured: nothing to prepare


def test_each_gpu_worker_sees_only_its_gpu_where_it_is_cuda_0():
    """cosyvoice2.devices [0, 1]: two workers, each with CUDA_VISIBLE_DEVICES naming its GPU and --device cuda:0,
    so every stream, graph and generator of the process is on that GPU (one process on cuda:1 of two visible GPUs
    failed at CUDA graph capture)."""
    config = load_config(None, {"engine.name": "cosyvoice2",
                                "engine.cosyvoice2": {"model_dir": "/m", "devices": [0, 1]}})
    plans = config.worker_plans()
    assert [(_worker_args(plan).device, worker_env(plan, {})["CUDA_VISIBLE_DEVICES"]) for plan in plans] == [
        ("cuda:0", "0"), ("cuda:0", "1")]
    # device numbers count the GPUs the gateway sees, as CUDA does
    assert [worker_env(plan, {"CUDA_VISIBLE_DEVICES": "2,3"})["CUDA_VISIBLE_DEVICES"] for plan in plans] == ["2", "3"]
    with pytest.raises(WorkerFailed, match=r"engine.cosyvoice2.devices: GPU 1 is not among the 1 the gateway sees"):
        worker_env(plans[1], {"CUDA_VISIBLE_DEVICES": "GPU-5e1d"})


def test_a_worker_gets_the_gateways_environment_less_what_systemd_handed_the_gateway_alone():
    plan, = load_config(None, {"engine.workers": 1}).worker_plans()
    inherited = {"PATH": "/usr/bin", "TORCHINDUCTOR_CACHE_DIR": "/var/cache/x", "NOTIFY_SOCKET": "/run/notify",
                 "LISTEN_FDS": "1", "LISTEN_PID": "7"}
    env = worker_env(plan, inherited)
    assert env == {"PATH": "/usr/bin", "TORCHINDUCTOR_CACHE_DIR": "/var/cache/x", "OMP_NUM_THREADS": "1"}
    assert "CUDA_VISIBLE_DEVICES" not in env  # a CPU worker: nothing to choose
