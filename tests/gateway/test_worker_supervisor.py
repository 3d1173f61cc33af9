"""The command line a supervised engine worker is started with: what the operator configured reaches the worker,
in arguments `python -m engine_service` accepts."""

from __future__ import annotations

from engine_service.__main__ import _parser
from gateway.config import load_config
from gateway.worker_supervisor import worker_command


def _worker_args(plan):
    command = worker_command(plan)
    assert command[1:3] == ["-m", "engine_service"]
    return _parser().parse_args(command[3:])


def test_workers_with_a_fixed_port_listen_on_port_plus_index():
    first, second = load_config(None, {"engine.workers": 2, "engine.worker.port": 7100}).worker_plans()
    assert (_worker_args(first).listen, _worker_args(second).listen) == ("127.0.0.1:7100", "127.0.0.1:7101")
