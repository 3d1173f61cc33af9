"""The first-audio estimate from measured times (passed in; no clock)."""

from engine_service.first_audio import HALF_LIFE_S, FirstAudioEstimate


def test_an_idle_engine_expects_its_own_first_chunk_time():
    estimate = FirstAudioEstimate()
    assert estimate.expected_s(10.0) == 0.0  # nothing measured yet
    estimate.opened(1, 10.0)
    estimate.first_chunk(1, 10.05)
    assert abs(estimate.expected_s(10.05) - 0.05) < 1e-9 and estimate.waiting == 0


def test_a_backlog_adds_the_measured_gap_per_waiting_stream():
    """A serial engine: each long job holds the thread 0.3 s; the queue drains one first chunk per 0.3 s."""
    estimate = FirstAudioEstimate()
    estimate.opened(1, 0.0)
    for stream in (2, 3, 4):
        estimate.opened(stream, 0.01)
    estimate.first_chunk(1, 0.02)
    estimate.first_chunk(2, 0.32)
    estimate.first_chunk(3, 0.62)
    assert estimate.waiting == 1
    assert abs(estimate.gap_s(0.62) - 0.3) < 1e-9
    assert abs(estimate.expected_s(0.62) - (0.02 + 0.3)) < 0.005  # the 0.02 s is 0.6 s old: faded a little
    estimate.gone(4)  # cancelled before it spoke
    assert estimate.waiting == 0 and abs(estimate.expected_s(0.62) - 0.02) < 0.005


def test_a_stall_on_the_first_stream_fades_and_a_good_stream_then_mostly_replaces_it():
    """Issue #31: one 0.8 s stall must not keep a worker over a 400 ms bound for good."""
    estimate = FirstAudioEstimate()
    estimate.opened(1, 0.0)
    estimate.first_chunk(1, 0.8)
    assert estimate.expected_s(0.8) > 0.4
    assert estimate.expected_s(0.8 + HALF_LIFE_S) <= 0.4  # half of it after one half-life
    later = 0.8 + 4 * HALF_LIFE_S
    estimate.opened(2, later)
    estimate.first_chunk(2, later + 0.03)
    assert estimate.expected_s(later + 0.03) < 0.1  # the old stall hardly drags the new figure


def test_samples_close_together_are_an_ordinary_weighted_mean():
    estimate = FirstAudioEstimate()
    for stream, at in enumerate((0.0, 0.2, 0.4, 0.6)):
        estimate.opened(stream, at)
        estimate.first_chunk(stream, at + (0.5 if stream == 0 else 0.05))
    # the 0.5 s outlier still counts (about 0.8^3 of its weight), not dropped, not dominating
    assert 0.15 < estimate.expected_s(0.65) < 0.3
