"""Config: defaults that work with no file, errors that name the key, routes that pick the right prompt."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest

from gateway.config import ConfigError, load_config
from gateway.config_sections import LOOPBACK_SOURCES

REPO = Path(__file__).resolve().parents[2]


def test_embedded_default_serves_loopback_with_espeak():
    config = load_config()
    assert (config.sip.listen.host, config.sip.listen.port) == ("127.0.0.1", 5060)
    assert config.sip.transports == ("udp", "tcp")
    assert (config.http_host, config.http_port) == ("127.0.0.1", 8080)
    assert config.engine.name == "espeak"
    assert config.allowed_sources == LOOPBACK_SOURCES
    router = config.prompt_resolver()
    assert router.route_for("1000") is not None and router.route_for("2000") is not None


@pytest.mark.parametrize("name", ["gateway.yaml", "gateway-cosyvoice2.yaml"])
def test_shipped_examples_load(name):
    config = load_config(REPO / "sip_config" / name)
    assert ipaddress.ip_address("192.0.2.10") in config.allowed_sources[0]
    assert config.prompt_resolver().route_for("1000").prompt == "welcome"


def test_cosyvoice2_example_passes_engine_settings_through():
    config = load_config(REPO / "sip_config" / "gateway-cosyvoice2.yaml")
    settings = config.engine_settings()
    assert settings["model_dir"] == "/opt/models/CosyVoice2-0.5B"
    assert (settings["device"], settings["dtype"]) == ("cuda", "bf16")
    # Every key the example sets is one the engine knows and accepts (it checks them at start).
    from engines.cosyvoice2.settings import CosyVoice2Settings

    engine = CosyVoice2Settings.from_config(settings)
    assert (engine.first_chunk_lanes, engine.compile_flow, engine.compile_hift, engine.slot_attention,
            engine.llm_fp8) == (3, True, True, True, False)


@pytest.mark.parametrize("overrides, expected", [
    ({"sip.listen": "5060"}, "sip.listen: expected HOST:PORT"),
    ({"sip.listen": "0.0.0.0:5060"}, "sip.advertised_host: required"),
    ({"sip.lisen": "127.0.0.1:5060"}, "sip.lisen: unknown field"),
    ({"sip.transports": ["udp", "sctp"]}, "sip.transports[1]:"),
    ({"sip.max_calls": 0}, "sip.max_calls:"),
    ({"trunks": [{"name": "pbx", "allow": ["10.0.0.0/33"]}]}, "trunks[0].allow[0]: expected an IP address or CIDR"),
    ({"trunks": [{"name": "pbx", "allow": []}]}, "trunks[0].allow: list at least one"),
    ({"trunks": [{"name": "pbx", "allow": ["10.0.0.1"]}, {"name": "pbx", "allow": ["10.0.0.2"]}]},
     "trunks[1].name: 'pbx' is used twice"),
    ({"media.rtp_port_range": "30000-20000"}, "media.rtp_port_range: expected 1024 <= LOW < HIGH"),
    ({"media.rtp_port_range": "lots"}, "media.rtp_port_range: expected LOW-HIGH"),
    ({"media.codecs": ["PCMU", "opus"]}, "media.codecs: unsupported codec OPUS"),
    ({"media.initial_playout_delay_ms": 1000}, "media.initial_playout_delay_ms: must not exceed"),
    ({"media.rtp_latching": "anyone"}, "media.rtp_latching: Input should be 'off', 'sdp_host' or 'signalling_source'"),
    ({"media.dtmf_max_per_second": 0}, "media.dtmf_max_per_second:"),
    ({"media.bind_address": "rtp.example.net"}, "media.bind_address: expected an IP address of this host"),
    ({"media.advertised_address": "0.0.0.0"}, "media.advertised_address: 0.0.0.0 is a wildcard, which peers "
                                              "cannot send to"),
    ({"sip.advertised_host": "::"}, "sip.advertised_host: :: is a wildcard"),
    ({"media.bind_address": "127.0.0.1", "media.advertised_address": "2001:db8::5"},
     "media.advertised_address: 2001:db8::5 is IPv6 but RTP binds IPv4 127.0.0.1 (media.bind_address)"),
    ({"engine.name": "festival"}, "engine.name: unknown engine 'festival'"),
    ({"engine.espeak.default_voice": "fr"}, "engine.espeak.default_voice:"),
    ({"engine.espeak.speed": 2}, "engine.espeak.speed: unknown field"),
    ({"prompts.hello": {"voice": "en"}}, "prompts.hello.text: required field is missing"),
    ({"prompts.hello": {"text": "hi", "voice": "fr"}}, "prompts.hello.voice: 'fr' is not a voice of engine espeak"),
    ({"routes": [{"match": "1", "prompt": "welcome"}, {"match": "2", "prompt": "welcome"},
                 {"match": "3", "prompt": "welcome", "voice": "en"}]}, "routes[2].voice: only with text"),
    ({"routes": [{"match": "1", "text": "hi", "colour": "red"}]}, "routes[0].colour: unknown field"),
    ({"routes": [{"match": "1"}]}, "routes[0].prompt: give either prompt"),
    ({"routes": [{"match": "1", "prompt": "goodbye"}]}, "routes[0].prompt: unknown prompt 'goodbye'"),
    ({"routes": [{"match": "1*2", "text": "hi"}]}, "routes[0].match: expected a number, a prefix"),
    ({"routes": [{"match": "1", "text": "hi", "after": "linger"}]}, "routes[0].after:"),
    ({"routes": [{"match": "1", "text": "hi", "early_media": True}]}, "routes[0].early_media: Input should be 'answer'"),
    ({"routes": [{"match": "1", "text": "hi", "early_media": "answer", "reject_code": 486}]},
     "routes[0].reject_code: only with early_media: reject"),
    ({"routes": [{"match": "1", "text": "hi", "early_media": "reject", "reject_code": 200}]},
     "routes[0].reject_code: Input should be greater than or equal to 400"),
    ({"sip.session_timers": {"expires_s": 60, "min_se_s": 90}}, "sip.session_timers.expires_s: must be at least"),
    ({"sip.session_timers": {"refresher": "uac"}}, "sip.session_timers.refresher: unknown field"),
    ({"http.listen": "localhost"}, "http.listen: expected HOST:PORT"),
    ({"logging.level": "loud"}, "logging.level:"),
    ({"shutdown.drain_timeout_s": -1}, "shutdown.drain_timeout_s:"),
    ({"voices": {"english": "klingon"}}, "voices.english: 'klingon' is not a voice"),
    ({"tunks": []}, "tunks: unknown field"),
])
def test_every_mistake_names_its_key(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_file_errors_name_the_file_and_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("sip:\n  listen: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: line \d+ not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- sip\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(tmp_path / "list.yaml")


@pytest.mark.parametrize("text", ["", "# nothing\n", "\n\n", "{}\n", "---\n"])
def test_an_empty_file_is_refused_naming_the_file(tmp_path, text):
    """A truncated or emptied file would run with no routes (every routed call 404) and /healthz 200."""
    (tmp_path / "empty.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"empty\.yaml: the file is empty; expected sections such as sip"):
        load_config(tmp_path / "empty.yaml")


def test_a_file_with_any_section_starts_with_defaults_for_the_rest(tmp_path):
    (tmp_path / "small.yaml").write_text("logging: {level: info}\n")
    config = load_config(tmp_path / "small.yaml")
    assert config.routes == () and config.allowed_sources == LOOPBACK_SOURCES


def test_overrides_apply_before_validation():
    config = load_config(None, {"sip.listen": "127.0.0.1:0", "engine.name": "instant", "http.listen": "[::1]:9090"})
    assert config.sip.listen.port == 0
    assert config.engine.name == "instant" and set(config.engine_settings()) >= {"voices", "chunk_ms"}
    assert (config.http_host, config.http_port) == ("::1", 9090)


def test_trunks_replace_the_loopback_default():
    config = load_config(None, {"trunks": [{"name": "pbx", "allow": ["192.0.2.10", "2001:db8::/32"]}]})
    assert config.allowed_sources == (ipaddress.ip_network("192.0.2.10/32"), ipaddress.ip_network("2001:db8::/32"))


def test_voices_of_a_discovering_engine_are_checked_after_start():
    config = load_config(REPO / "sip_config" / "gateway-cosyvoice2.yaml")
    config.check_voices(["alice", "wei"])
    with pytest.raises(ConfigError, match=r"voices.mandarin: 'wei' is not a voice of engine cosyvoice2"):
        config.check_voices(["alice"])


def test_sections_become_the_sip_and_media_settings():
    config = load_config(REPO / "sip_config" / "gateway.yaml")
    sip = config.sip_settings()
    assert (sip.listen_host, sip.listen_port, sip.transports) == ("0.0.0.0", 5060, ("udp", "tcp"))
    assert sip.advertised_host == "192.0.2.20" and sip.max_calls == 200 and sip.t1 == 0.5
    assert sip.allowed_sources == config.allowed_sources
    media = config.media_settings()
    assert (media.rtp_port_min, media.rtp_port_max, media.codecs) == (20000, 30000, ("PCMU", "PCMA", "G722"))
    assert media.codec_order == "offer"
    assert media.advertised_host == "192.0.2.20"
    assert (media.rtp_latching, media.dtmf_max_per_second) == ("off", 10)


def test_rtp_latching_accepts_unquoted_yaml_off_and_the_media_layers_modes(tmp_path):
    from typing import get_args

    from gateway.config_sections import MediaSection
    from gateway.media.rtp_peer import Latching

    assert get_args(MediaSection.model_fields["rtp_latching"].annotation) == get_args(Latching)
    (tmp_path / "nat.yaml").write_text("media:\n  rtp_latching: off\n")
    assert load_config(tmp_path / "nat.yaml").media_settings().rtp_latching == "off"  # YAML 1.1 reads it as false
    (tmp_path / "nat.yaml").write_text("media:\n  rtp_latching: signalling_source\n")
    assert load_config(tmp_path / "nat.yaml").media_settings().rtp_latching == "signalling_source"


def test_engine_worker_keys_are_validated_and_plan_one_worker_per_gpu():
    from gateway.config import ConfigError, load_config

    config = load_config(None, {"engine.name": "cosyvoice2",
                                "engine.cosyvoice2": {"model_dir": "/m", "devices": [0, 1], "max_batch": 4}})
    plans = config.engine.worker_plans()
    # each worker sees only its GPU (CUDA_VISIBLE_DEVICES=gpu), where it is cuda:0
    assert [(p.name, p.gpu, p.device) for p in plans] == [("cosyvoice2-cuda:0", 0, "cuda:0"),
                                                          ("cosyvoice2-cuda:1", 1, "cuda:0")]
    assert plans[0].settings == {"model_dir": "/m", "max_batch": 4}  # devices is the gateway's, not the engine's
    assert load_config(None, {}).engine.worker_plans() == []  # espeak in the gateway process by default
    assert len(load_config(None, {"engine.workers": 2}).engine.worker_plans()) == 2
    for overrides, message in [
        ({"engine.workers": -1}, "engine.workers:"),
        ({"engine.cosyvoice2": {"devices": [0, 0]}}, "engine.cosyvoice2.devices: a device is listed twice"),
        ({"engine.cosyvoice2": {"devices": [0]}, "engine.workers": 2}, "engine.workers: 2 workers but 1"),
        ({"engine.remote.urls": ["http://h:1"]}, "engine.remote.urls:"),
        ({"engine.name": "remote"}, "engine.remote.urls: engine remote needs"),
        ({"engine.admission.max_first_audio_ms": 0}, "engine.admission.max_first_audio_ms:"),
        ({"engine.worker.colour": 1}, "engine.worker.colour: unknown field"),
    ]:
        with pytest.raises(ConfigError) as caught:
            load_config(None, overrides)
        assert str(caught.value).startswith(message), (overrides, str(caught.value))


@pytest.mark.parametrize("overrides, expected", [
    ({"sip.tcp.max_connections": 0}, "sip.tcp.max_connections:"),
    ({"sip.tcp.max_connections": 10, "sip.tcp.max_connections_per_source": 20},
     "sip.tcp.max_connections_per_source: must not exceed max_connections"),
    ({"sip.tcp.idle_timeout_s": 0}, "sip.tcp.idle_timeout_s:"),
    ({"sip.tcp.read_timeout_s": -1}, "sip.tcp.read_timeout_s:"),
    ({"sip.tcp.keepalive": 1}, "sip.tcp.keepalive: unknown field"),
    ({"sip.max_message_bytes": 100}, "sip.max_message_bytes:"),
    ({"sip.flood.max_requests_per_s_per_source": 0}, "sip.flood.max_requests_per_s_per_source:"),
    ({"sip.flood.max_requests_per_s_per_source": 900}, "sip.flood.max_requests_per_s: must not be below"),
    ({"sip.flood.max_junk_per_s": 0}, "sip.flood.max_junk_per_s:"),
    ({"sip.flood.max_junk_per_s_per_source": 500}, "sip.flood.max_junk_per_s: must not be below"),
    ({"sip.tcp.max_unsent_bytes": 100}, "sip.tcp.max_unsent_bytes:"),
])
def test_sip_abuse_limits_name_their_key(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_sip_abuse_limits_reach_the_sip_settings():
    sip = load_config(REPO / "sip_config" / "gateway.yaml").sip_settings()
    limits = sip.stream_limits
    assert (limits.max_connections, limits.max_connections_per_source) == (500, 50)
    assert (limits.idle_timeout_s, limits.read_timeout_s, limits.max_message_bytes) == (60, 10, 65535)
    assert limits.max_unsent_bytes == 262144
    assert (sip.flood.per_source_per_s, sip.flood.total_per_s) == (100, 500)
    assert (sip.flood.junk_per_source_per_s, sip.flood.junk_total_per_s) == (10, 100)
    default = load_config(None, {"sip.flood.max_requests_per_s_per_source": 5}).sip_settings()
    assert default.flood.per_source_per_s == 5 and default.stream_limits.max_connections == 500


def test_supervised_workers_listen_on_consecutive_fixed_ports_and_serve_the_speech_api_only_there():
    block = {"api_keys": [{"name": "jambonz", "key": "j" * 24, "max_streams": 10}]}
    fixed = load_config(None, {"engine.workers": 2, "engine.worker.port": 7100})  # /metrics scrapable, no API
    assert [(plan.listen_port, plan.tts_api) for plan in fixed.worker_plans()] == [(7100, None), (7101, None)]
    asked = load_config(None, {"engine.workers": 2, "engine.worker.port": 8090, "tts_api": block})
    assert [(plan.listen_port, plan.tts_api) for plan in asked.worker_plans()] == [(8090, block), (8091, block)]
    assert load_config(None, {"engine.workers": 0, "tts_api": block}).tts_api == block  # a standalone worker's


def test_a_speech_api_supervised_workers_cannot_serve_is_a_config_error_naming_both_keys():
    """Without a fixed port the API's clients could not know where it is: an error, not silence (#33 item 6)."""
    block = {"api_keys": [{"name": "jambonz", "key": "j" * 24, "max_streams": 10}]}
    with pytest.raises(ConfigError) as caught:
        load_config(None, {"engine.workers": 2, "tts_api": block})
    assert str(caught.value) == ("tts_api: supervised workers serve the speech API only on fixed ports: set "
                                 "engine.worker.port (worker i listens on port + i), or remove tts_api")


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"engine.workers": 1, "engine.worker.api_port": 8090},
     "engine.worker.api_port: unknown field; the worker's one port is engine.worker.port"),
    ({"engine.workers": 3, "engine.worker.port": 65534}, "engine.worker.port: 3 workers listen on 65534 to 65536"),
    ({"engine.workers": 1, "engine.worker.token": "shared"},
     "engine.worker.token: other gateways can share the supervised workers only at known ports"),
])
def test_worker_port_mistakes_name_their_key(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert str(caught.value).startswith(expected), str(caught.value)


def test_supervised_workers_log_at_the_gateways_level():
    config = load_config(None, {"engine.workers": 2, "logging.level": "warning"})
    assert [plan.log_level for plan in config.worker_plans()] == ["warning", "warning"]


def test_a_typo_in_the_cosyvoice2_block_is_a_one_line_error_at_load():
    from gateway.config import ConfigError, load_config

    for block, expected in [({"model_dir": "/m", "compile_flw": True}, "engine.cosyvoice2: unknown key(s) compile_flw"),
                            ({"model_dir": "/m", "dtype": "fp64"}, "engine.cosyvoice2.dtype: 'fp64'"),
                            ({"compile_flow": True}, "engine.cosyvoice2.model_dir: required"),
                            ({"model_dir": "/m", "first_hop_tokens": 0},
                             "engine.cosyvoice2.first_hop_tokens: must be")]:
        with pytest.raises(ConfigError) as caught:
            load_config(None, {"engine.name": "cosyvoice2", "engine.cosyvoice2": block})
        assert str(caught.value).startswith(expected), str(caught.value)


@pytest.mark.parametrize(("overrides", "bind", "advertised"), [
    ({}, "127.0.0.1", "127.0.0.1"),
    # a cloud host with a 1:1 NAT public address: SIP and RTP bind local addresses, callers are told the public one
    ({"sip.listen": "0.0.0.0:5060", "sip.advertised_host": "203.0.113.5"}, "0.0.0.0", "203.0.113.5"),
    ({"sip.listen": "[::]:5060", "sip.advertised_host": "203.0.113.5"}, "0.0.0.0", "203.0.113.5"),
    ({"sip.listen": "10.0.0.5:5060", "sip.advertised_host": "203.0.113.5"}, "10.0.0.5", "203.0.113.5"),
    ({"sip.listen": "10.0.0.5:5060", "media.advertised_address": "198.51.100.7"}, "10.0.0.5", "198.51.100.7"),
    ({"media.bind_address": "0.0.0.0", "media.advertised_address": "198.51.100.7"}, "0.0.0.0", "198.51.100.7"),
])
def test_rtp_binds_a_local_address_and_the_sdp_advertises_another(overrides, bind, advertised):
    media = load_config(None, overrides).media_settings()
    assert (media.bind_host, media.advertised_host) == (bind, advertised)


@pytest.mark.parametrize(("overrides", "expected"), [
    ({"mrcp.listen": "1544"}, "mrcp.listen: expected HOST:PORT"),
    ({"mrcp.enabled": "sometimes"}, "mrcp.enabled: "),
    ({"mrcp.max_message_bytes": 100}, "mrcp.max_message_bytes: "),
    ({"mrcp.tls": {"cert": "/nonexistent/cert.pem", "key": "/nonexistent/key.pem"}},
     "mrcp.tls.cert: no such file: /nonexistent/cert.pem"),
    ({"mrcp.tls": {"cert": __file__, "key": __file__}}, "mrcp.tls.cert: certificate "),
])
def test_mrcp_mistakes_name_their_key(overrides, expected):
    with pytest.raises(ConfigError) as caught:
        load_config(None, overrides)
    assert caught.value.errors[0].startswith(expected), caught.value.errors


def test_mrcp_is_off_unless_enabled_and_takes_the_voice_aliases():
    assert load_config(None).mrcp_settings() is None
    settings = load_config(None, {"mrcp.enabled": True, "mrcp.listen": "0.0.0.0:1544",
                                  "voices": {"en-US": "en"}}).mrcp_settings()
    assert (settings.listen_host, settings.listen_port, settings.voice_aliases) == ("0.0.0.0", 1544, (("en-US", "en"),))
