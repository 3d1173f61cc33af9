"""The HTTP listeners' keys (http.*, engine.worker.*): validated at load, errors naming the key path, and what
reaches the listeners."""

from __future__ import annotations

import pytest

from connection_caps.listener import HttpLimits
from gateway.config import ConfigError, load_config
from gateway.worker_supervisor import worker_command


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"http": {"max_connections": 0}}, "http.max_connections: Input should be greater than or equal to 1"),
    ({"http": {"max_connections": 10, "max_connections_per_source": 20}},
     "http.max_connections_per_source: must not exceed max_connections"),
    ({"http": {"header_timeout_s": 0}}, "http.header_timeout_s: Input should be greater than 0"),
    ({"engine": {"worker": {"idle_timeout_s": -1}}}, "engine.worker.idle_timeout_s: Input should be greater than 0"),
    ({"engine": {"worker": {"link_reserve": 0}}},
     "engine.worker.link_reserve: Input should be greater than or equal to 1"),
])
def test_a_bad_cap_names_its_key(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert expected in str(caught.value)


def test_the_caps_reach_the_gateway_listener_and_the_workers_command_line():
    config = load_config(None, {"http": {"max_connections": 10, "idle_timeout_s": 5},
                                "engine": {"name": "espeak", "workers": 1,
                                           "worker": {"max_connections": 50, "link_reserve": 3}}})
    # a small total alone lowers the per-source default with it
    assert config.http.http_limits() == HttpLimits(10, 10, 5.0, 10.0)
    command = worker_command(config.engine.worker_plans()[0])
    limits = command[command.index("--http-limits") + 1]
    assert '"max_connections": 50' in limits and '"link_reserve": 3' in limits
