"""The streaming protocol's frames, byte- and JSON-exact: what a worker written in another language must match."""

from __future__ import annotations

import numpy as np
import pytest

from engine_service import protocol
from engines.base import EngineUnavailable, FirstAudioTooLate, NoCapacity, SynthesisRefused, TextTooLong, UnknownVoice


def test_open_serializes_to_compact_json_in_field_order():
    frame = protocol.Open(stream=7, text="你好", voice="zh", call_id="c1", options={"seed": 3})
    assert protocol.serialize(frame) == ('{"stream":7,"text":"你好","voice":"zh","call_id":"c1","options":{"seed":3},'
                                         '"sample_rate":24000,"format":"f32le","type":"open"}')
    assert protocol.parse(protocol.serialize(frame)) == frame


def test_an_unpaced_open_says_so_and_a_paced_one_reads_as_before():
    """`paced` is sent only when false, so a worker from before it reads every live open."""
    frame = protocol.Open(stream=7, text="hi", voice="en", paced=False)
    assert protocol.serialize(frame).endswith('"format":"f32le","paced":false,"type":"open"}')
    assert protocol.parse(protocol.serialize(frame)) == frame
    assert '"paced"' not in protocol.serialize(protocol.Open(stream=7, text="hi", voice="en"))
    assert protocol.parse('{"type":"open","stream":1,"text":"hi","voice":"en"}').paced is True


def test_open_with_only_the_required_fields_takes_the_defaults():
    frame = protocol.parse('{"type":"open","stream":1,"text":"hi","voice":"en"}')
    assert frame == protocol.Open(stream=1, text="hi", voice="en", call_id="", options={}, sample_rate=24000,
                                  format="f32le")


@pytest.mark.parametrize("frame", [
    protocol.Cancel(3), protocol.Opened(3), protocol.End(3), protocol.Failed(3, "boom"),
    protocol.Refused(3, "no_capacity", "full"), protocol.Error(None, "bad"),
    protocol.Status("ready", 8, 5, 2, 120.5, opens_seen=9),
    protocol.Status("ready", 8, 5, 2, 120.5, opens_seen=9, graphs="compiling"),
    protocol.Hello(1, "espeak", ("en", "zh"), "en", 24000, 2000),
])
def test_every_frame_round_trips(frame):
    assert protocol.parse(protocol.serialize(frame)) == frame


def test_status_is_exact_json():
    assert protocol.serialize(protocol.Status("warming", 4, 3, opens_seen=1)) == ('{"state":"warming","slots_total":4,'
        '"slots_free":3,"queue_depth":0,"first_audio_ms":0.0,"opens_seen":1,"type":"status"}')


@pytest.mark.parametrize("text, message, stream", [
    ("not json", "frame is not JSON", None),
    ("[1, 2]", "frame must be a JSON object", None),
    ('{"type":"shout","stream":4}', "unknown frame type 'shout'", 4),
    ('{"type":"open","stream":4,"text":"hi"}', "open: missing field(s) voice", 4),
    ('{"type":"open","stream":4,"text":"hi","voice":"en","colour":"red"}', "open: unknown field(s) colour", 4),
    ('{"type":"open","stream":4,"text":5,"voice":"en"}', "open.text: expected str, got int", 4),
    ('{"type":"open","stream":true,"text":"x","voice":"en"}', "open.stream: expected int, got bool", None),
    ('{"type":"open","stream":4,"text":"x","voice":"en","format":"mp3"}', "open.format: 'mp3'", 4),
    ('{"type":"cancel","stream":-1}', "cancel.stream: must be 0..4294967295", None),
    ('{"type":"refused","stream":2,"reason":"tired"}', "refused.reason: 'tired'", 2),
    ('{"type":"status","state":"ready","slots_total":2,"slots_free":1}', "status: missing field(s) opens_seen", None),
    ('{"type":"status","state":"ready","slots_total":2,"slots_free":1,"opens_seen":"3"}',
     "status.opens_seen: expected int, got str", None),
    ('{"type":"status","state":"ready","slots_total":2,"slots_free":1,"opens_seen":3,"graphs":"fast"}',
     "status.graphs: 'fast'; one of compiled, compiling, failed", None),
])
def test_malformed_frames_name_the_problem_and_the_stream(text, message, stream):
    with pytest.raises(protocol.ProtocolError) as caught:
        protocol.parse(text)
    assert str(caught.value).startswith(message)
    assert caught.value.stream == stream


def test_audio_frame_is_a_big_endian_stream_id_then_pcm():
    samples = np.array([0.0, 0.5, -1.0], dtype=np.float32)
    assert protocol.encode_audio(258, samples, "f32le") == b"\x00\x00\x01\x02" + samples.astype("<f4").tobytes()
    assert protocol.encode_audio(1, samples, "s16le") == b"\x00\x00\x00\x01" + bytes.fromhex("0000" "0040" "0080")
    stream, decoded = protocol.decode_audio(protocol.encode_audio(258, samples, "f32le"), {258: "f32le"})
    assert stream == 258 and decoded.dtype == np.float32 and np.array_equal(decoded, samples)
    _, decoded16 = protocol.decode_audio(protocol.encode_audio(1, samples, "s16le"), {1: "s16le"})
    assert np.allclose(decoded16, samples, atol=1 / 32768)


def test_audio_for_an_unknown_stream_is_dropped_and_a_torn_frame_is_an_error():
    assert protocol.decode_audio(b"\x00\x00\x00\x09abcd", {1: "f32le"})[1].size == 0
    with pytest.raises(protocol.ProtocolError, match="not whole f32le samples"):
        protocol.decode_audio(b"\x00\x00\x00\x01abc", {1: "f32le"})
    with pytest.raises(protocol.ProtocolError, match="shorter than its 4-byte header"):
        protocol.decode_audio(b"\x00\x01", {})


@pytest.mark.parametrize("refusal, reason", [
    (UnknownVoice("x"), "unknown_voice"), (TextTooLong("x"), "too_long"), (NoCapacity("x"), "no_capacity"),
    (FirstAudioTooLate("x"), "no_capacity"), (EngineUnavailable("x"), "unavailable"),
    (SynthesisRefused("x"), "bad_request"),
])
def test_refusals_map_to_wire_reasons_and_back_to_the_same_sip_answer(refusal, reason):
    assert protocol.refusal_reason(refusal) == reason
    back = protocol.refusal_error(protocol.Refused(1, reason, "why"))
    assert back.sip_status == refusal.sip_status and str(back) == "why"
