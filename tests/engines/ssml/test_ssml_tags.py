"""Each SSML tag, in English and Mandarin: the segments an engine is handed (the text it speaks, the silences)."""

from __future__ import annotations

import pytest

from engines.segmented import speech_request
from engines.ssml import Pause, Speech, SsmlError, parse_ssml


def texts(document: str, **kwargs) -> list[str | int]:
    """What the engine gets, in order: each speech segment's text, each pause as its milliseconds."""
    return [s.text if isinstance(s, Speech) else s.ms for s in parse_ssml(document, **kwargs)]


@pytest.mark.parametrize(("document", "spoken"), [
    # speak, unknown tags (their text), p/s (a short pause after)
    ("<speak>Hello <emphasis>there</emphasis> <foo>friend</foo>.</speak>", ["Hello there friend."]),
    ("<speak>你好，<emphasis>朋友</emphasis>。</speak>", ["你好，朋友。"]),
    ('<speak xmlns="http://www.w3.org/2001/10/synthesis" version="1.0"><p>One.</p><p>Two.</p></speak>',
     ["One.", 300, "Two.", 300]),
    # break: time and strength, bare break = medium
    ('<speak>Press one <break time="800ms"/> or two <break time="1.5s"/> or <break/> three</speak>',
     ["Press one", 800, "or two", 1500, "or", 500, "three"]),
    ('<speak>请按一<break time="800ms"/>或者按二<break strength="x-strong"/>谢谢</speak>',
     ["请按一", 800, "或者按二", 1000, "谢谢"]),
    # say-as telephone: digits one by one, in the number's groups
    ('<speak>Call <say-as interpret-as="telephone">+1 (555) 123-4567</say-as></speak>',
     ["Call plus one, five five five, one two three, four five six seven"]),
    ('<speak>请拨打<say-as interpret-as="telephone">13812345678</say-as></speak>', ["请拨打幺三八，幺二三四，五六七八"]),
    # say-as digits and characters
    ('<speak>Code <say-as interpret-as="digits">2048</say-as></speak>', ["Code two zero four eight"]),
    ('<speak>验证码<say-as interpret-as="digits">2048</say-as></speak>', ["验证码二零四八"]),
    ('<speak>Ref <say-as interpret-as="characters">AB12</say-as></speak>', ["Ref A B one two"]),
    ('<speak>编号<say-as interpret-as="characters">AB12</say-as></speak>', ["编号A B一二"]),
    # say-as cardinal and ordinal
    ('<speak>Balance <say-as interpret-as="cardinal">1234</say-as></speak>',
     ["Balance one thousand two hundred thirty-four"]),
    ('<speak>余额<say-as interpret-as="cardinal">1234</say-as>元</speak>', ["余额一千二百三十四元"]),
    ('<speak><say-as interpret-as="cardinal">-10005.5</say-as></speak>', ["minus ten thousand five point five"]),
    ('<speak>共<say-as interpret-as="cardinal">100010</say-as>人</speak>', ["共十万零一十人"]),
    ('<speak>You are <say-as interpret-as="ordinal">22</say-as> in line</speak>', ["You are twenty-second in line"]),
    ('<speak>您排在<say-as interpret-as="ordinal">22</say-as>位</speak>', ["您排在第二十二位"]),
    # say-as date with format
    ('<speak><say-as interpret-as="date" format="mdy">3/5/2024</say-as></speak>', ["March fifth, twenty twenty-four"]),
    ('<speak><say-as interpret-as="date" format="dmy">05.03.2024</say-as></speak>', ["March fifth, twenty twenty-four"]),
    ('<speak><say-as interpret-as="date" format="ymd">2005-12-31</say-as></speak>',
     ["December thirty-first, two thousand five"]),
    ('<speak><say-as interpret-as="date" format="ymd">2024-03-05</say-as></speak>', ["March fifth, twenty twenty-four"]),
    ('<speak>日期<say-as interpret-as="date" format="ymd">2024-03-05</say-as></speak>', ["日期二零二四年三月五日"]),
    ('<speak>日期<say-as interpret-as="date" format="dmy">25/12/2024</say-as></speak>', ["日期二零二四年十二月二十五日"]),
    # say-as time
    ('<speak>At <say-as interpret-as="time">14:05</say-as></speak>', ["At two oh five PM"]),
    ('<speak>At <say-as interpret-as="time">9:00 am</say-as></speak>', ["At nine o'clock AM"]),
    ('<speak>时间<say-as interpret-as="time">14:05</say-as></speak>', ["时间十四点零五分"]),
    ('<speak>时间<say-as interpret-as="time">2:00</say-as></speak>', ["时间两点整"]),
    # say-as currency
    ('<speak>Due <say-as interpret-as="currency">$12.50</say-as></speak>', ["Due twelve dollars and fifty cents"]),
    ('<speak>Due <say-as interpret-as="currency">1 EUR</say-as></speak>', ["Due one euro"]),
    ('<speak>应付<say-as interpret-as="currency">¥12.50</say-as></speak>', ["应付十二元五角"]),
    ('<speak>应付<say-as interpret-as="currency">USD 3.05</say-as></speak>', ["应付三美元五美分"]),
    # say-as with an interpret-as we do not know: its text as written
    ('<speak><say-as interpret-as="unit">5kg</say-as></speak>', ["5kg"]),
    # sub
    ('<speak><sub alias="World Wide Web">WWW</sub> site</speak>', ["World Wide Web site"]),
    ('<speak><sub alias="世界卫生组织">WHO</sub>总部</speak>', ["世界卫生组织总部"]),
    # phoneme: the text is spoken (CosyVoice2 takes text, not pinyin or IPA)
    ('<speak><phoneme alphabet="ipa" ph="təˈmɑːtəʊ">tomato</phoneme></speak>', ["tomato"]),
    ('<speak><phoneme alphabet="pinyin" ph="zhong4 yao4">重要</phoneme>的事</speak>', ["重要的事"]),
    # xml:lang picks the reading language
    ('<speak xml:lang="zh-CN"><say-as interpret-as="cardinal">12</say-as></speak>', ["十二"]),
    ('<speak>价格<lang xml:lang="en-US"><say-as interpret-as="cardinal">12</say-as></lang></speak>',
     ["价格twelve"]),
    # without xml:lang, the words before a say-as choose its language; at the start, the document's
    ('<speak><say-as interpret-as="cardinal">3</say-as>号，余额<say-as interpret-as="cardinal">12</say-as>，'
     'balance <say-as interpret-as="cardinal">12</say-as></speak>', ["三号，余额十二，balance twelve"]),
])
def test_each_tag_gives_the_engine_these_words_and_silences(document, spoken):
    assert texts(document) == spoken


def test_prosody_rate_and_volume_travel_with_their_text():
    segments = parse_ssml('<speak>Normal <prosody rate="slow" volume="-6dB">slow and soft</prosody> '
                          '<prosody rate="150%">fast</prosody> <prosody volume="loud">loud</prosody></speak>')
    assert segments == (Speech("Normal"), Speech("slow and soft", rate=0.75, volume_db=-6.0), Speech("fast", rate=1.5),
                        Speech("loud", volume_db=6.0))
    zh = parse_ssml('<speak>正常<prosody rate="x-slow">很慢</prosody></speak>')
    assert zh == (Speech("正常"), Speech("很慢", rate=0.5))


def test_audio_src_plays_a_configured_prompt_else_its_fallback_text():
    prompts = {"welcome": (Speech("Welcome to Acme."), Pause(200))}
    segments = parse_ssml('<speak><audio src="welcome"/>Your balance follows. '
                          '<audio src="missing">Sorry, no music.</audio></speak>', audio=prompts.get)
    assert segments == (Speech("Welcome to Acme.", prompt="welcome"), Pause(200), Speech("Your balance follows. "
                                                                                       "Sorry, no music."))
    with pytest.raises(SsmlError, match="no configured prompt"):
        parse_ssml('<speak><audio src="missing"/></speak>', audio=prompts.get)


@pytest.mark.parametrize(("document", "problem"), [
    ("<speak>Hello <break time='300ms'>", "not well-formed"),
    ("<say>hi</say>", "root element must be <speak>"),
    ('<speak><break time="fast"/></speak>', "expected e.g. 500ms"),
    ('<speak><break time="11s"/></speak>', "at most 10 s"),
    ('<speak><break strength="huge"/></speak>', "choose one of"),
    ('<speak><say-as interpret-as="date" format="mdy">2024</say-as></speak>', "does not match format"),
    ('<speak><say-as interpret-as="date" format="mdy">13/45/2024</say-as></speak>', "no such month"),
    ('<speak><say-as interpret-as="cardinal">twelve</say-as></speak>', "is not a number"),
    ('<speak><say-as interpret-as="telephone">call me</say-as></speak>', "not a telephone number"),
    ('<speak><say-as interpret-as="currency">12.50</say-as></speak>', "needs an amount and a currency"),
    ('<speak><prosody rate="5">too fast</prosody></speak>', "between 0.5 and 2"),
    ('<speak><sub>WWW</sub></speak>', "needs alias"),
])
def test_a_document_that_cannot_be_spoken_is_refused_naming_why(document, problem):
    with pytest.raises(SsmlError, match=problem):
        parse_ssml(document)


@pytest.mark.parametrize("document", [
    # billion laughs: entity expansion is never attempted
    '<?xml version="1.0"?><!DOCTYPE lolz [<!ENTITY lol "lol"><!ENTITY lol1 "&lol;&lol;&lol;&lol;&lol;&lol;">'
    '<!ENTITY lol2 "&lol1;&lol1;&lol1;&lol1;&lol1;&lol1;">]><speak>&lol2;</speak>',
    # external entity (XXE)
    '<?xml version="1.0"?><!DOCTYPE speak [<!ENTITY xxe SYSTEM "file:///etc/passwd">]><speak>&xxe;</speak>',
])
def test_doctype_and_entities_are_refused_not_expanded(document):
    with pytest.raises(SsmlError, match="refused"):
        parse_ssml(document)


def test_speech_request_reads_ssml_by_its_start_or_when_asked_and_text_otherwise():
    ssml = speech_request('<speak>Hi<break time="200ms"/>there</speak>', "en")
    assert ssml.text == "Hi there" and ssml.segments == (Speech("Hi"), Pause(200), Speech("there"))
    plain = speech_request("<speak>Hi</speak>", "en", ssml=False)
    assert plain.text == "<speak>Hi</speak>" and plain.segments == ()
    assert speech_request("1 < 2", "en").segments == ()
    with pytest.raises(SsmlError, match="not well-formed"):
        speech_request("just text", "en", ssml=True)
    assert speech_request("&amp; <speak>", "en").segments == ()  # not starting with <speak: plain text
