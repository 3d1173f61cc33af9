"""Route lookup and prompt resolution (gateway/routing.py) over a validated config."""

import pytest

from gateway.config import load_config
from gateway.routing import BadHeader, NoPrompt, Prompt
from gateway.sip.message import parse


def test_route_lookup_prefers_exact_then_longest_prefix():
    config = load_config(None, {
        "prompts": {"p": {"text": "hello"}},
        "routes": [
            {"match": "*", "text": "anything"},
            {"match": "49*", "text": "germany"},
            {"match": "4930*", "text": "berlin"},
            {"match": "4930123", "text": "one number"},
            {"match": "4930*", "text": "second berlin, never chosen"},
        ],
    })
    router = config.prompt_resolver("en")
    assert router.route_for("4930123").text == "one number"
    assert router.route_for("4930999").text == "berlin"
    assert router.route_for("4989").text == "germany"
    assert router.route_for("1000").text == "anything"
    assert load_config(None, {"routes": [{"match": "1000", "text": "x"}]}).prompt_resolver("en").route_for("2000") is None


def test_route_prompts_resolve_voice_aliases_and_after():
    config = load_config(None, {
        "voices": {"mandarin": "zh"},
        "prompts": {"hello_zh": {"text": "您好", "voice": "mandarin", "barge_in": True}},
        "routes": [{"match": "1", "prompt": "hello_zh", "after": "stay"}, {"match": "2", "text": "hi"}],
    })
    router = config.prompt_resolver("en")
    assert router.prompt_for_route(router.route_for("1")) == Prompt("您好", "zh", hangup_after=False, barge_in=True,
                                                                    cache=True)
    assert router.prompt_for_route(router.route_for("2")) == Prompt("hi", "en", cache=True)


def test_configured_texts_are_cached_unless_a_prompt_or_route_says_no_and_prerender_lists_each_once():
    config = load_config(None, {
        "prompts": {"menu": {"text": "Press one.", "prerender": True}, "live": {"text": "Now", "cache": False}},
        "routes": [{"match": "1", "prompt": "menu"}, {"match": "2", "prompt": "live"},
                   {"match": "3", "prompt": "menu", "cache": False}, {"match": "4", "text": "Hold.", "prerender": True},
                   {"match": "5", "text": "<speak>Wait.<break time='1s'/></speak>", "prerender": True}],
    })
    router = config.prompt_resolver("en")
    assert [router.prompt_for_route(router.route_for(n)).cache for n in "1234"] == [True, False, False, True]
    # SSML is neither cached by a call nor prerendered (gateway/call.py)
    assert sorted((p.text, p.voice) for p in router.prerendered()) == [("Hold.", "en"), ("Press one.", "en")]


class _Offered:
    """What the router reads of an InboundCall: the parsed INVITE and its dialed user."""

    def __init__(self, user: str, headers: str = "") -> None:
        raw = (f"INVITE sip:{user}@gw.example.com SIP/2.0\r\n"
               "Via: SIP/2.0/UDP 192.0.2.10:5060;branch=z9hG4bK-r1\r\n"
               "From: <sip:alice@example.com>;tag=1\r\nTo: <sip:{user}@gw.example.com>\r\n"
               f"Call-ID: routing-test\r\nCSeq: 1 INVITE\r\n{headers}Content-Length: 0\r\n\r\n")
        self.invite = parse(raw.encode())
        self.request_user = user


def test_x_tts_headers_win_over_the_route_and_resolve_voice_aliases():
    router = load_config(None, {"voices": {"mandarin": "zh"}}).prompt_resolver("en")
    spoken = router(_Offered("1000", "X-TTS-Text: %E4%BD%A0%E5%A5%BD\r\nX-TTS-Voice: mandarin\r\n"
                                     "X-TTS-After: stay\r\n"))
    assert spoken == Prompt("你好", "zh", hangup_after=False)
    assert router(_Offered("1000")).text.startswith("Hello! This is the CosyVoice gateway")


def test_a_header_text_is_cached_only_when_x_tts_cache_says_yes():
    router = load_config(None).prompt_resolver("en")
    assert not router(_Offered("1000", "X-TTS-Text: hi\r\n")).cache
    assert router(_Offered("1000", "X-TTS-Text: hi\r\nX-TTS-Cache: yes\r\n")).cache
    assert not router(_Offered("1000", "X-TTS-Text: hi\r\nX-TTS-Cache: no\r\n")).cache


def test_no_header_and_no_route_is_no_prompt():
    router = load_config(None, {"routes": [{"match": "1000", "text": "x"}]}).prompt_resolver("en")
    with pytest.raises(NoPrompt, match="'2000'"):
        router(_Offered("2000"))


def test_early_media_from_the_route_or_the_header():
    router = load_config(None, {"routes": [
        {"match": "1", "text": "closed", "early_media": "reject", "reject_code": 486},
        {"match": "2", "text": "hold on", "early_media": "ring"},
        {"match": "3", "text": "hi"},
    ]}).prompt_resolver("en")
    assert router(_Offered("1")) == Prompt("closed", "en", early_media="reject", reject_code=486, cache=True)
    assert router(_Offered("2")).early_media == "ring"
    assert router(_Offered("3")).early_media is None
    # The header chooses for a header prompt, and over the route's choice on a routed call.
    assert router(_Offered("3", "X-TTS-Early-Media: Answer\r\n")).early_media == "answer"
    assert router(_Offered("2", "X-TTS-Early-Media: reject\r\nX-TTS-Reject-Code: 603\r\n")) == Prompt(
        "hold on", "en", early_media="reject", reject_code=603, cache=True)
    header = router(_Offered("9", "X-TTS-Text: hi\r\nX-TTS-Early-Media: reject\r\n"))
    assert (header.early_media, header.reject_code) == ("reject", 480)


@pytest.mark.parametrize("headers, message", [
    ("X-TTS-Early-Media: later\r\n", "X-TTS-Early-Media: expected one of answer, reject, ring"),
    ("X-TTS-Early-Media: reject\r\nX-TTS-Reject-Code: 200\r\n", "X-TTS-Reject-Code: expected a SIP status 400-699"),
    ("X-TTS-Early-Media: ring\r\nX-TTS-Reject-Code: 486\r\n", "X-TTS-Reject-Code: only with X-TTS-Early-Media: reject"),
])
def test_a_bad_early_media_header_names_itself(headers, message):
    router = load_config(None, {"routes": [{"match": "3", "text": "hi"}]}).prompt_resolver("en")
    with pytest.raises(BadHeader, match=message):
        router(_Offered("3", headers))


def test_ssml_routes_and_headers_give_segments_and_audio_src_plays_a_configured_prompt():
    from engines.ssml import Pause, Speech, SsmlError

    config = load_config(None, {
        "prompts": {"welcome": {"text": "Welcome to Acme."}},
        "routes": [{"match": "1", "text": '<speak><audio src="welcome"/><break time="400ms"/>'
                                          'Your balance is <say-as interpret-as="cardinal">42</say-as>.</speak>'}],
    })
    router = config.prompt_resolver("en")
    prompt = router(_Offered("1"))
    assert prompt.segments == (Speech("Welcome to Acme.", prompt="welcome"), Pause(400),
                               Speech("Your balance is forty-two."))
    assert prompt.text == "Welcome to Acme. Your balance is forty-two."
    assert config.prompt_texts() == ("Welcome to Acme.", "Your balance is forty-two.")  # what engines prepare
    header = router(_Offered("1", "X-TTS-Type: ssml\r\nX-TTS-Text: %3Cspeak%3Ehi%3Cbreak/%3Ethere%3C/speak%3E\r\n"))
    assert header.segments == (Speech("hi"), Pause(500), Speech("there"))
    plain = router(_Offered("1", "X-TTS-Type: text\r\nX-TTS-Text: %3Cspeak%3Ehi\r\n"))
    assert plain.segments == () and plain.text == "<speak>hi"
    with pytest.raises(SsmlError, match="not well-formed"):
        router(_Offered("1", "X-TTS-Text: %3Cspeak%3Ehi\r\n"))


def test_ssml_in_the_config_is_checked_at_load_naming_the_key():
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=r"prompts\.bad\.text: .*not well-formed"):
        load_config(None, {"prompts": {"bad": {"text": "<speak>hi"}}})
    with pytest.raises(ConfigError, match=r"routes\[0\]\.text: <audio src='nope'>: no configured prompt"):
        load_config(None, {"routes": [{"match": "1", "text": '<speak><audio src="nope"/></speak>'}]})


def test_instruct_or_dialect_from_the_route_or_the_header():
    """CosyVoice3's instruct / dialect per route, per call (X-TTS-Instruct, X-TTS-Dialect, over the route's),
    handed to the engine as request options, never as text; the engine checks the name."""
    router = load_config(None, {"routes": [
        {"match": "1", "text": "你好", "dialect": "cantonese"},
        {"match": "2", "text": "hi", "instruct": "happy"},
        {"match": "3", "text": "hi"},
    ]}).prompt_resolver("en")
    assert router(_Offered("1")) == Prompt("你好", "en", cache=True, options=(("dialect", "cantonese"),))
    assert router(_Offered("2")).options == (("instruct", "happy"),)
    assert router(_Offered("3")).options == ()
    assert router(_Offered("1", "X-TTS-Instruct: Sad\r\n")).options == (("instruct", "sad"),)
    header = router(_Offered("9", "X-TTS-Text: hi\r\nX-TTS-Dialect: sichuan\r\n"))
    assert (header.text, header.options) == ("hi", (("dialect", "sichuan"),))
    with pytest.raises(BadHeader, match="X-TTS-Instruct and X-TTS-Dialect: give one"):
        router(_Offered("9", "X-TTS-Text: hi\r\nX-TTS-Dialect: sichuan\r\nX-TTS-Instruct: sad\r\n"))


def test_a_route_with_both_instruct_and_dialect_is_refused_naming_the_key():
    from gateway.config import ConfigError

    with pytest.raises(ConfigError, match=r"routes\[0\]\.dialect: give instruct or dialect, not both"):
        load_config(None, {"routes": [{"match": "1", "text": "hi", "dialect": "sichuan", "instruct": "sad"}]})
