"""The command line a supervised engine worker is started with: what the operator configured reaches the worker,
in arguments `python -m engine_service` accepts."""

from __future__ import annotations

import json

import pytest

from engine_service.__main__ import _parser
from gateway.config import load_config
from gateway.worker_supervisor import worker_command


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
