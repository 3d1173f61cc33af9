"""The first-audio estimate from measured times (passed in; no clock)."""

from engine_service.first_audio import FirstAudioEstimate


def test_an_idle_engine_expects_its_own_first_chunk_time():
    estimate = FirstAudioEstimate()
    assert estimate.expected_s() == 0.0  # nothing measured yet
    estimate.opened(1, 10.0)
    estimate.first_chunk(1, 10.05)
    assert abs(estimate.expected_s() - 0.05) < 1e-9 and estimate.waiting == 0


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
    assert abs(estimate.gap_s - 0.3) < 1e-9
    assert abs(estimate.expected_s() - (0.02 + 0.3)) < 1e-9
    estimate.gone(4)  # cancelled before it spoke
    assert estimate.waiting == 0 and abs(estimate.expected_s() - 0.02) < 1e-9
