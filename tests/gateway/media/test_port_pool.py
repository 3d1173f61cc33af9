"""RTP port pairs: even RTP ports, RTCP on +1, not reused right away."""

from __future__ import annotations

import pytest

from gateway.media.port_pool import RtpPortPool


def test_even_ports_round_robin_and_release() -> None:
    pool = RtpPortPool(20001, 20008)
    assert list(pool.candidates()) == [20002, 20004, 20006]  # 20008 has no RTCP port in range
    pool.acquire(20002)
    assert next(pool.candidates()) == 20004
    pool.acquire(20004)
    pool.release(20002)
    assert list(pool.candidates()) == [20006, 20002]  # the released port goes to the back
    assert pool.in_use == 1


def test_range_without_a_pair_is_refused() -> None:
    with pytest.raises(ValueError):
        RtpPortPool(20001, 20002)
