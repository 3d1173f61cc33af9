"""RFC 4733 telephone-events: one key press per event, whatever the retransmits."""

from __future__ import annotations

from gateway.media.dtmf import DtmfDetector, TelephoneEvent


def test_payload_bytes() -> None:
    # Digit 5, end bit, volume 10 dBm0, duration 800 (100 ms at 8 kHz) — RFC 4733 §2.3 layout.
    event = TelephoneEvent(event=5, end=True, volume=10, duration=800)
    assert event.serialize() == bytes.fromhex("05 8a 0320")
    assert TelephoneEvent.parse(bytes.fromhex("05 8a 0320")) == event
    assert TelephoneEvent.parse(bytes.fromhex("0b 0a 00a0")).digit == "#"
    assert TelephoneEvent.parse(bytes.fromhex("10 0a 00a0")).digit is None  # flash is not a digit


def _key_press(event: int, durations=(160, 320, 480, 640)) -> list[bytes]:
    packets = [TelephoneEvent(event, False, 10, d).serialize() for d in durations]
    return packets + [TelephoneEvent(event, True, 10, durations[-1] + 160).serialize()] * 3


def test_one_digit_per_event_despite_updates_and_end_retransmits() -> None:
    detector = DtmfDetector()
    digits = []
    for timestamp, event in [(1000, 1), (3000, 1), (5000, 11), (7000, 15)]:
        for payload in _key_press(event):
            digit = detector.feed(0x42, timestamp, payload)
            if digit is not None:
                digits.append(digit)
    assert digits == ["1", "1", "#", "D"]


def test_event_whose_start_was_lost_still_counts_once() -> None:
    detector = DtmfDetector()
    end = TelephoneEvent(9, True, 10, 800).serialize()
    assert [detector.feed(1, 160, end) for _ in range(3)] == ["9", None, None]


def test_late_end_retransmit_of_previous_event_is_ignored() -> None:
    detector = DtmfDetector()
    assert detector.feed(1, 100, TelephoneEvent(2, False, 10, 160).serialize()) == "2"
    assert detector.feed(1, 900, TelephoneEvent(3, False, 10, 160).serialize()) == "3"
    assert detector.feed(1, 100, TelephoneEvent(2, True, 10, 800).serialize()) is None
