"""Playout buffer: when a prompt starts, what an underrun sounds like, how it ends."""

from __future__ import annotations

import numpy as np

from gateway import metrics
from gateway.media.playout import PlayoutBuffer, PlayoutSettings


def ramp(n: int, start: int = 0) -> np.ndarray:
    return (start + np.arange(n)).astype(np.int16)


def test_float_audio_is_stored_as_pcm16() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=20))
    buffer.push(np.full(160, 0.5, dtype=np.float32), now=0.0)
    frame = buffer.pop_frame()
    assert frame.dtype == np.int16 and (frame == 16384).all()


def drain(buffer: PlayoutBuffer) -> list[np.ndarray | None]:
    frames = []
    while True:
        frame = buffer.pop_frame()
        frames.append(frame)
        if frame is None or buffer.finished:
            return frames


def test_holds_back_until_initial_delay_is_buffered() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=60))
    buffer.push(ramp(400), now=0.0)  # 50 ms < 60 ms
    assert buffer.pop_frame() is None
    buffer.push(ramp(100, 400), now=0.0)  # 62.5 ms
    frame = buffer.pop_frame()
    assert frame is not None and np.array_equal(frame, ramp(160))


def test_short_prompt_starts_as_soon_as_the_stream_ends() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=200))
    buffer.push(ramp(200), now=0.0)
    assert buffer.pop_frame() is None
    buffer.end_of_stream()
    first, last = buffer.pop_frame(), buffer.pop_frame()
    assert np.array_equal(first, ramp(160))
    assert np.array_equal(last[:40], ramp(40, 160)) and not last[40:].any()  # partial frame padded with zeros
    assert buffer.finished and buffer.pop_frame() is None


def test_underrun_is_counted_filled_with_zeros_and_raises_the_threshold() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=40, underrun_step_ms=40))
    before = metrics.registry.get_sample_value("gateway_playout_underruns_total") or 0.0
    buffer.push(ramp(320), now=0.0)
    threshold = buffer.start_threshold
    assert buffer.pop_frame() is not None and buffer.pop_frame() is not None
    silence = buffer.pop_frame()
    assert silence is not None and silence.shape == (160,) and not silence.any()
    assert buffer.underruns == 1
    assert metrics.registry.get_sample_value("gateway_playout_underruns_total") == before + 1
    assert buffer.start_threshold > threshold
    # Refilling below the raised threshold keeps the slot filled with silence, never old audio.
    buffer.push(ramp(160, 1000), now=0.1)
    assert not buffer.pop_frame().any() and buffer.underruns == 2
    buffer.push(ramp(buffer.start_threshold, 2000), now=0.1)
    assert np.array_equal(buffer.pop_frame(), ramp(160, 1000))


def test_running_dry_is_one_event_and_the_first_says_how_much_had_played() -> None:
    # A first chunk of 5 frames, then the next too late: one event of several silent slots, the first at 0.1 s
    # of the prompt; a second event later leaves the first where it was.
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=20, underrun_step_ms=40))
    frame = buffer.frame_samples

    def play_until_dry(events: int) -> None:
        for _ in range(1000):
            if buffer.underrun_events == events:
                return
            buffer.pop_frame()
        raise AssertionError("the buffer never ran dry")

    buffer.push(ramp(5 * frame), now=0.0)
    play_until_dry(1)
    for _ in range(3):  # still dry: more silent slots, no new event
        buffer.pop_frame()
    assert (buffer.underruns, buffer.underrun_events) == (4, 1)
    assert buffer.first_underrun_s == 5 * frame / buffer.sample_rate
    # More than the most any start can ask for (this arrival also teaches the buffer a longer drain).
    buffer.push(ramp(buffer.sample_rate * buffer.settings.max_delay_ms // 1000 + 2 * frame), now=0.5)
    play_until_dry(2)
    assert buffer.first_underrun_s == 5 * frame / buffer.sample_rate
    # A new prompt that plays out whole adds nothing; the call's first event stays the call's.
    buffer.begin_prompt()
    buffer.push(ramp(2 * buffer.start_threshold), now=1.0)
    buffer.end_of_stream()
    drain(buffer)
    assert buffer.underrun_events == 2 and buffer.first_underrun_s == 5 * frame / buffer.sample_rate


def test_start_threshold_learns_the_engines_chunk_gaps() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=20, max_delay_ms=400))
    # 200 ms chunks, real time on average, but one 450 ms gap after a chunk that carried 200 ms:
    # playback started at any arrival would have drained 250 ms before the next chunk.
    for now in (0.0, 0.05, 0.5, 0.6):
        buffer.push(ramp(1600), now=now)
    assert 0.24 * 8000 <= buffer.start_threshold <= 0.26 * 8000
    buffer.flush()
    buffer.push(ramp(800), now=10.0)  # next prompt: the learnt jitter still applies
    assert buffer.pop_frame() is None


def test_threshold_is_bounded_by_max_delay() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(max_delay_ms=100))
    buffer.push(ramp(160), now=0.0)
    buffer.push(ramp(160), now=5.0)  # a 5 s stall
    assert buffer.start_threshold == 800


def test_flush_discards_everything() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=20))
    buffer.push(ramp(8000), now=0.0)
    assert buffer.pop_frame() is not None
    buffer.flush()
    assert buffer.buffered == 0 and buffer.pop_frame() is None and not buffer.finished


def test_whole_prompt_comes_out_in_order() -> None:
    buffer = PlayoutBuffer()
    audio = ramp(8000 + 37)
    for start in range(0, audio.size, 999):
        buffer.push(audio[start : start + 999], now=0.0)
    buffer.end_of_stream()
    frames = drain(buffer)
    assert len(frames) == 51 and buffer.finished
    assert np.array_equal(np.concatenate(frames)[: audio.size], audio)


def test_starting_says_the_first_frame_of_a_prompt_is_ready_and_only_that_one() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=40))
    buffer.begin_prompt()
    buffer.push(ramp(160), now=0.0)  # 20 ms < 40 ms: still filling
    assert not buffer.starting
    buffer.push(ramp(320, 160), now=0.0)
    assert buffer.starting
    assert np.array_equal(buffer.pop_frame(), ramp(160)) and not buffer.starting
    assert buffer.pop_frame() is not None and buffer.pop_frame() is not None
    assert not buffer.pop_frame().any() and not buffer.starting  # an underrun refills mid-prompt: not a start


def test_at_16khz_frames_are_320_samples_and_delays_count_in_time() -> None:
    """G.722: the same 20 ms frames and millisecond delays, twice the samples."""
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=60), sample_rate=16000)
    buffer.push(ramp(800), now=0.0)  # 50 ms at 16 kHz < 60 ms
    assert buffer.pop_frame() is None
    buffer.push(ramp(200, 800), now=0.0)  # 62.5 ms
    frame = buffer.pop_frame()
    assert frame is not None and np.array_equal(frame, ramp(320))
    buffer.end_of_stream()
    frames = drain(buffer)
    assert [f.size for f in frames] == [320, 320, 320] and buffer.finished  # 680 left: the last 40 padded


def test_a_cache_hit_plays_from_the_shared_prompt_not_a_copy_per_call() -> None:
    """A thousand calls playing one cached 30-s prompt must not hold a thousand copies of it (480 MB)."""
    prompt = ramp(16000)  # 2 s, the whole prompt at once as a hit hands it over
    calls = [PlayoutBuffer(PlayoutSettings(initial_delay_ms=20)) for _ in range(3)]
    for buffer in calls:
        buffer.push(prompt, now=0.0)
        buffer.end_of_stream()
    for buffer in calls:
        frames = drain(buffer)
        assert np.shares_memory(frames[0], prompt)
        assert np.array_equal(np.concatenate(frames), prompt)
    assert (prompt == ramp(16000)).all()  # played, never written


def test_a_chunk_arriving_while_audio_waits_is_appended_in_order() -> None:
    buffer = PlayoutBuffer(PlayoutSettings(initial_delay_ms=20))
    first = ramp(400)
    buffer.push(first, now=0.0)
    head = buffer.pop_frame()
    buffer.push(ramp(400, 400), now=0.01)
    buffer.end_of_stream()
    assert np.array_equal(np.concatenate([head, *drain(buffer)])[:800], ramp(800))
    assert np.array_equal(first, ramp(400))
