"""The shared 20 ms packet clock: deadlines fixed from t0, no drift, a bounded catch-up."""

from __future__ import annotations

import asyncio

import pytest

from gateway.media.packet_clock import PERIOD_S, PacketClock, due_ticks


def test_catch_up_policy() -> None:
    t0 = 100.0
    assert due_ticks(t0 + 5 * PERIOD_S + 0.001, t0, 5, 3) == (range(5, 6), 0)  # on time
    assert due_ticks(t0 + 4.9999999 * PERIOD_S, t0, 5, 3) == (range(5, 6), 0)  # a hair early
    assert due_ticks(t0 + 7.5 * PERIOD_S, t0, 5, 3) == (range(5, 8), 0)  # 2 behind: run them now
    assert due_ticks(t0 + 20.5 * PERIOD_S, t0, 5, 3) == (range(17, 21), 12)  # stalled: skip 12


@pytest.mark.timeout(20)
async def test_ticks_stay_on_their_deadlines_for_two_seconds() -> None:
    loop = asyncio.get_running_loop()
    clock = PacketClock()
    seen: list[tuple[int, float, float]] = []
    finished = loop.create_future()

    def on_tick(index: int, deadline: float) -> None:
        seen.append((index, deadline, loop.time()))
        if len(seen) == 100 and not finished.done():
            finished.set_result(None)

    clock.subscribe(on_tick)
    clock.start()
    try:
        await finished
    finally:
        clock.stop()
    indices = [index for index, _, _ in seen]
    assert indices[-1] - indices[0] >= 99
    for index, deadline, ran_at in seen:
        assert deadline == pytest.approx(clock.t0 + index * PERIOD_S, abs=1e-9)
        # Timing-sensitive (shared 2-core CI box): generous per-tick bound...
        assert -0.001 <= ran_at - deadline < 0.050
    # ...and no accumulation: the last ticks are no later than the first ones, on average.
    late = [ran_at - deadline for _, deadline, ran_at in seen]
    assert sum(late[-20:]) / 20 < 0.010


async def _ticks(clock: PacketClock, count: int) -> list[tuple[int, float, float]]:
    """The next `count` ticks as (index, deadline, ran_at), from a subscriber of their own."""
    loop = asyncio.get_running_loop()
    seen: list[tuple[int, float, float]] = []
    enough = loop.create_future()

    def on_tick(index: int, deadline: float) -> None:
        seen.append((index, deadline, loop.time()))
        if len(seen) == count:
            clock.unsubscribe(on_tick)
            enough.set_result(None)

    clock.subscribe(on_tick)
    await asyncio.wait_for(enough, 5)
    return seen


async def test_unsubscribe_and_a_failing_subscriber_do_not_stop_the_others() -> None:
    clock = PacketClock()
    calls: list[int] = []

    def broken(index: int, deadline: float) -> None:
        raise RuntimeError("boom")

    def counting(index: int, deadline: float) -> None:
        calls.append(index)
        if len(calls) == 3:
            clock.unsubscribe(counting)

    clock.subscribe(broken)
    clock.subscribe(counting)
    clock.start()
    try:
        later = await _ticks(clock, 6)  # the clock ticks on past the third
    finally:
        clock.stop()
    assert len(calls) == 3 and later[-1][0] > calls[-1]


async def test_bulk_work_that_polls_the_clock_does_not_hold_a_tick_back() -> None:
    loop = asyncio.get_running_loop()
    clock = PacketClock()
    clock.start()
    burst_window: list[float] = []

    def burst() -> None:  # 150 ms of back-to-back work in ONE callback, polling between items
        start = loop.time()
        end = start + 0.150
        while loop.time() < end:
            sum(range(2000))
            clock.run_if_due()
        burst_window[:] = [start, loop.time()]

    try:
        await _ticks(clock, 3)
        loop.call_soon(burst)
        seen = await _ticks(clock, 12)  # 240 ms: the burst and a few ticks after it
    finally:
        clock.stop()
    start, end = burst_window
    inside = [ran_at for _, deadline, ran_at in seen if start < deadline < end - PERIOD_S]
    # Without polling, every tick due inside the burst would run after it, up to 150 ms late.
    assert len(inside) >= 5 and all(ran_at < end for ran_at in inside)


async def test_calls_are_spread_over_phases_and_each_keeps_a_20ms_period() -> None:
    loop = asyncio.get_running_loop()
    clock = PacketClock(phases=4)
    seen: dict[int, list[tuple[int, float]]] = {n: [] for n in range(8)}
    ten_each = loop.create_future()

    def record(n: int, index: int, deadline: float) -> None:
        seen[n].append((index, deadline))
        if all(len(ticks) >= 10 for ticks in seen.values()) and not ten_each.done():
            ten_each.set_result(None)

    for n in range(8):
        clock.subscribe(lambda index, deadline, n=n: record(n, index, deadline))
    clock.start()
    try:
        await asyncio.wait_for(ten_each, 5)
    finally:
        clock.stop()
    offsets = set()
    for ticks in seen.values():
        indices = [index for index, _ in ticks]
        assert indices == list(range(indices[0], indices[0] + len(indices)))  # one packet per period
        deadlines = [deadline for _, deadline in ticks]
        assert all(b - a == pytest.approx(PERIOD_S) for a, b in zip(deadlines, deadlines[1:]))
        offsets.add(round((deadlines[0] - clock.t0 - indices[0] * PERIOD_S) * 1000, 3))
    assert offsets == {0.0, 5.0, 10.0, 15.0}  # two calls in each of the four 5 ms slots


async def test_last_tick_names_the_newest_tick_each_slot_has_run() -> None:
    """What a talkspurt's first packet is stamped with when it goes out between ticks (call_media)."""
    loop = asyncio.get_running_loop()
    clock = PacketClock(phases=4)
    served: dict[int, list[int]] = {0: [], 1: []}
    seen_by_both = loop.create_future()

    def record(n: int, index: int, deadline: float) -> None:
        served[n].append(index)
        if len(served[1]) >= 3 and not seen_by_both.done():
            seen_by_both.set_result(None)

    first, second = (lambda index, deadline: record(0, index, deadline)), (lambda index, deadline: record(1, index, deadline))
    clock.subscribe(first)
    clock.subscribe(second)  # the next 5 ms slot of each period
    assert clock.last_tick(first) is None  # nothing has run yet
    clock.start()
    try:
        await asyncio.wait_for(seen_by_both, 5)
        assert clock.last_tick(first) == served[0][-1] and clock.last_tick(second) == served[1][-1]
    finally:
        clock.stop()
    assert clock.last_tick(lambda index, deadline: None) is None  # not subscribed
