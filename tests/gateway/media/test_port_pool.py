"""RTP port pairs: even RTP ports with RTCP on +1, drawn at random, a just-released port not reused at once."""

from __future__ import annotations

import itertools

import pytest

from gateway.media.port_pool import RtpPortPool


def _take(pool: RtpPortPool) -> int:
    port = next(pool.candidates())
    pool.acquire(port)
    return port


def test_every_even_port_with_its_rtcp_port_in_range_is_offered_once() -> None:
    pool = RtpPortPool(20001, 20008)
    assert sorted(pool.candidates()) == [20002, 20004, 20006]  # 20008 has no RTCP port in range


def test_ports_are_drawn_at_random_not_in_order() -> None:
    pool = RtpPortPool(20000, 29999)
    drawn = [_take(pool) for _ in range(20)]
    assert all(port % 2 == 0 and 20000 <= port and port + 1 <= 29999 for port in drawn)
    assert len(set(drawn)) == 20 and pool.in_use == 20
    # In order, each port would be 2 above the last: a third party could aim at the next call.
    steps = [b - a for a, b in itertools.pairwise(drawn)]
    assert sum(step == 2 for step in steps) < 5
    assert drawn != sorted(drawn) and len(set(steps)) > 10


def test_a_released_port_waits_behind_every_other_free_port() -> None:
    pool = RtpPortPool(20000, 20006)  # three pairs: 20000, 20002, 20004
    first = _take(pool)
    pool.release(first)
    for _ in range(50):  # random order, but the quarantined port always comes last
        assert list(pool.candidates())[-1] == first
    others = [_take(pool), _take(pool)]
    assert first not in others
    assert _take(pool) == first  # nothing else free: the quarantine gives way
    assert pool.in_use == 3 and list(pool.candidates()) == []


def test_a_failed_bind_is_not_offered_twice_in_one_round() -> None:
    pool = RtpPortPool(20000, 20010)
    offered = []
    for port in pool.candidates():  # as RtpSession.bind does when every bind fails
        pool.acquire(port)
        offered.append(port)
        pool.release(port)
    assert sorted(offered) == [20000, 20002, 20004, 20006, 20008]


def test_a_port_another_call_took_meanwhile_is_not_offered() -> None:
    pool = RtpPortPool(20000, 20080)  # 40 pairs
    first_call = pool.candidates()
    for _ in range(17):  # its binds failed, past the random draws: the rest of the range is listed
        next(first_call)
    for port in range(20000, 20080, 2):  # meanwhile (binds await) other calls took every port
        pool.acquire(port)
    assert list(first_call) == []


def test_range_without_a_pair_is_refused() -> None:
    with pytest.raises(ValueError):
        RtpPortPool(20001, 20002)
