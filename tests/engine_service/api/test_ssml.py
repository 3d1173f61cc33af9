"""SSML is spoken as its words: tags out (as spaces), entities decoded, jambonz's <speak test."""

from __future__ import annotations

from engine_service.api.ssml import is_ssml, ssml_text


def test_tags_become_spaces_and_entities_are_decoded():
    document = '<speak>Hello<break time="500ms"/>world &amp; <emphasis level="strong">you</emphasis>.</speak>'
    assert ssml_text(document) == "Hello world & you ."


def test_chinese_text_survives():
    assert ssml_text("<speak><p>你好。</p><p>再见。</p></speak>") == "你好。 再见。"


def test_is_ssml_matches_jambonz_rule():
    assert is_ssml("<speak>hi</speak>")
    assert is_ssml('  <speak version="1.0">hi</speak>')
    assert not is_ssml("hi <speak>")
