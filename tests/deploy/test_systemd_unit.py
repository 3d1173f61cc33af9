"""The shipped systemd unit keeps what a GPU host needs between restarts."""

from __future__ import annotations

from pathlib import Path

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "cosyvoice-gateway.service"


def _service_settings() -> dict[str, list[str]]:
    """[Service] keys to their values in order (systemd allows a key more than once)."""
    settings: dict[str, list[str]] = {}
    section = None
    for raw in UNIT.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("["):
            section = line
        elif section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_the_compiler_cache_lives_in_the_units_cache_directory() -> None:
    """With PrivateTmp torch's default cache (/tmp) is emptied at every start: a restart would
    compile the flow and decode steps cold, minutes before the gateway answers again."""
    service = _service_settings()
    assert service["PrivateTmp"] == ["yes"]
    cache_root = Path("/var/cache") / service["CacheDirectory"][0]
    env = dict(item.split("=", 1) for value in service.get("Environment", []) for item in value.split())
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert var in env, f"{var} is not set: torch would cache under the private /tmp"
        assert Path(env[var]).is_relative_to(cache_root), f"{var}={env[var]} is outside {cache_root}"


def test_reload_sends_sighup_which_the_gateway_handles() -> None:
    """`systemctl reload` must re-read the config, not kill the process and drop live calls (the SIGHUP
    handling itself is tested in tests/integration/test_sighup_reload.py)."""
    assert _service_settings()["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
