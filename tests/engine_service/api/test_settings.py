"""The tts_api config block: defaults that are safe, and errors that name the key."""

from __future__ import annotations

import pytest
import yaml

from engine_service.api import TtsApiConfigError, TtsApiSettings

GOOD = """
tts_api:
  api_keys:
    - name: jambonz
      key: "jambonz-secret-0123456789"
      max_streams: 20
    - name: bot
      key: "bot-secret-0123456789abc"
  max_text_chars: 500
  jambonz_sample_rate: 16000
"""


def test_yaml_block_validates_into_typed_settings():
    settings = TtsApiSettings.from_mapping(yaml.safe_load(GOOD)["tts_api"])
    assert [key.name for key in settings.api_keys] == ["jambonz", "bot"]
    assert settings.api_keys[1].max_streams == 10
    assert settings.key_for("bot-secret-0123456789abc").name == "bot"
    assert settings.key_for("bot-secret-0123456789abd") is None
    assert "secret" not in repr(settings.api_keys[0])


def test_no_block_means_no_keys_so_nobody_gets_in():
    assert TtsApiSettings.from_mapping(None).api_keys == ()


@pytest.mark.parametrize(("block", "message"), [
    ({"api_keys": [{"name": "a", "key": "short"}]}, "tts_api.api_keys[0].key: String should have at least 16"),
    ({"api_keys": [{"name": "a", "key": "k" * 16, "max_streams": 0}]},
     "tts_api.api_keys[0].max_streams: Input should be greater than or equal to 1"),
    ({"api_keys": [{"name": "a", "key": "k" * 16, "max_stream": 3}]}, "tts_api.api_keys[0].max_stream: unknown field"),
    ({"api_keys": [{"name": "a", "key": "k" * 16}, {"name": "a", "key": "j" * 16}]},
     "tts_api.api_keys: two keys share the name a"),
    ({"api_keys": [{"name": "a", "key": "k" * 16}, {"name": "b", "key": "k" * 16}]},
     "tts_api.api_keys: two keys share the key of 'b'"),
    ({"jambonz_sample_rate": 44100}, "tts_api.jambonz_sample_rate: must be one of 8000, 16000, 24000"),
    ({"default_sample_rate": 22050}, "tts_api.default_sample_rate: must be one of 8000, 16000, 24000"),
    ({"max_text_chars": 0}, "tts_api.max_text_chars: Input should be greater than or equal to 1"),
    ({"play_url": {"max_age_s": -1}}, "tts_api.play_url.max_age_s: Input should be greater than or equal to 0"),
    ({"play_url": {"max_age": 60}}, "tts_api.play_url.max_age: unknown field"),
    ({"play_url": {"max_signed_ttl_s": 0}}, "tts_api.play_url.max_signed_ttl_s: Input should be greater than"),
])
def test_mistakes_are_named_by_key_path(block, message):
    with pytest.raises(TtsApiConfigError) as caught:
        TtsApiSettings.from_mapping(block)
    assert any(line.startswith(message) for line in caught.value.errors), caught.value.errors
