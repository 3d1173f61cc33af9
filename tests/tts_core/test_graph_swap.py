"""The swap of graph groups (tts_core/accel/graph_swap.py) as the runtime uses it: the worker serves on
eager-module graphs and a background thread publishes the compiled groups; the replaying thread
adopts a group only at its swap point, whole, and lets the old one go only after `settle`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from tts_core.accel.flow_pool_graphs import PooledFlowGraphs
from tts_core.accel.graph_swap import GraphSwap
from tts_core.flow import load_flow
from tts_core.hift import load_hift
from tts_core.runtime.chunk_render import ChunkRenderer, FlowPoolSettings


def test_owner_replays_the_current_group_until_its_swap_point_then_the_newest_whole() -> None:
    eager = ("eager", "eager")
    swap = GraphSwap(eager, "decode")
    settled: list[tuple[str, str]] = []
    assert swap.take(settled.append) is eager and swap.swaps == 0 and not settled
    swap.publish(("compiled-1", "compiled-1"))
    swap.publish(("compiled-2", "compiled-2"))  # published before the owner looked: replaces the first unseen
    assert swap.pending and swap.current is eager  # nothing changes before the owner's swap point
    assert swap.take(settled.append) == ("compiled-2", "compiled-2")
    assert settled == [eager] and swap.swaps == 1 and not swap.pending
    assert swap.take(settled.append) == ("compiled-2", "compiled-2") and swap.swaps == 1


def test_a_group_published_from_another_thread_is_adopted_whole_by_the_replaying_thread() -> None:
    """The replaying thread sees each generation's parts together and generations only move
    forward, however the publisher's thread interleaves with it."""
    swap = GraphSwap((0, 0))
    seen: list[tuple[int, int]] = []
    settled_on: set[str] = set()
    done = threading.Event()

    def replay() -> None:
        while not done.is_set() or swap.pending:
            seen.append(swap.take(lambda old: settled_on.add(threading.current_thread().name)))

    owner = threading.Thread(target=replay, name="owner")
    owner.start()
    for generation in range(1, 200):
        swap.publish((generation, generation))
    done.set()
    owner.join(10)
    assert not owner.is_alive()
    assert all(a == b for a, b in seen), "a group's parts came from two generations"
    assert [a for a, _ in seen] == sorted(a for a, _ in seen), "a generation went back"
    assert seen[-1] == (199, 199) and settled_on == {"owner"}


def test_a_render_lane_swaps_its_flow_solves_and_hift_graphs_together_at_its_render(tiny_model_dir: Path) -> None:
    """CPU: a renderer's lane holds its group; a published one is taken at the lane's next render
    call (`RenderLane.adopt`), flow solves and HiFT graphs together, and not before."""
    renderer = ChunkRenderer(load_flow(tiny_model_dir), load_hift(tiny_model_dir),
                             FlowPoolSettings(stream_slots=2, first_lanes=1))
    lane = renderer.lanes["first-0"]
    lane.graphs = PooledFlowGraphs(renderer.pooled)
    eager_solves, eager_hift = lane.graphs.solve_graphs, lane.hift_graphs
    lane.swap = GraphSwap((eager_solves, eager_hift), lane.name)
    compiled_solves, compiled_hift = {}, {}
    lane.swap.publish((compiled_solves, compiled_hift))
    assert lane.graphs.solve_graphs is eager_solves and lane.hift_graphs is eager_hift
    lane.adopt()
    assert lane.graphs.solve_graphs is compiled_solves and lane.hift_graphs is compiled_hift
    assert lane.swap.swaps == 1
    lane.adopt()  # nothing new: no swap
    assert lane.swap.swaps == 1 and renderer.lanes["later"].swap is None


def test_the_replaced_group_is_let_go_off_the_owner_thread_a_piece_at_a_time() -> None:
    """A CUDA graph's destructor holds the GIL (~0.6 us a node): the owner that adopts a new group hands the old one
    to the reaper thread, which drops its pieces one by one, each on its own (not the whole group at once)."""
    import weakref

    from tts_core.accel.graph_swap import REAPER

    class Graphs:  # stands for a captured graph set: what its finalizer sees is the thread that dropped it
        pass

    dropped: list[tuple[str, float]] = []
    solves = {key: Graphs() for key in range(3)}
    hift = [Graphs(), Graphs()]
    for piece in (*solves.values(), *hift):
        weakref.finalize(piece, lambda: dropped.append((threading.current_thread().name, time.perf_counter())))
    swap = GraphSwap((solves, hift), "first-0")
    del solves, hift, piece
    swap.publish(({}, []))
    before = REAPER.reaped
    swap.take()
    assert not any(name == threading.current_thread().name for name, _ in dropped)
    deadline = time.monotonic() + 5
    while len(dropped) < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dropped) == 5 and {name for name, _ in dropped} == {"graph-reaper"}
    assert REAPER.reaped - before >= 5
    times = sorted(at for _, at in dropped)
    assert all(b - a >= REAPER.PAUSE_S * 0.5 for a, b in zip(times, times[1:])), "pieces dropped at once"


def _finalized(count: int) -> tuple[list, list[float]]:
    """`count` stand-ins for captured graph sets in a list, and where their finalizers note when each went."""
    import weakref

    class Graphs:
        pass

    dropped: list[float] = []
    group = [Graphs() for _ in range(count)]
    for piece in group:
        weakref.finalize(piece, lambda: dropped.append(time.monotonic()))
    return group, dropped


def test_a_retired_group_waits_until_synthesis_is_quiet() -> None:
    """Dropped beside a call, a group's destructors took the GIL between that call's launches (a lone call's solve
    11-19 ms and decode 26 ms slower on the H200): the reaper holds it while a registered check says jobs run."""
    from tts_core.accel.graph_swap import Reaper

    reaper = Reaper()
    busy = threading.Event()
    busy.set()
    release = reaper.hold_while(busy.is_set)
    group, dropped = _finalized(3)
    reaper.retire(group)
    del group
    time.sleep(0.4)
    assert dropped == [], "let go while a job was running"
    quiet_at = time.monotonic()
    busy.clear()
    deadline = time.monotonic() + 5
    while len(dropped) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dropped) == 3 and min(dropped) >= quiet_at
    release()


def test_a_host_never_quiet_still_lets_its_old_graphs_go() -> None:
    from tts_core.accel.graph_swap import Reaper

    reaper = Reaper()
    reaper.MAX_HOLD_S = 0.3
    release = reaper.hold_while(lambda: True)
    group, dropped = _finalized(2)
    retired_at = time.monotonic()
    reaper.retire(group)
    del group
    deadline = time.monotonic() + 5
    while len(dropped) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dropped) == 2 and min(dropped) - retired_at >= 0.25
    release()
    # A check taken back holds nothing: the next group goes at once.
    group, dropped = _finalized(1)
    retired_at = time.monotonic()
    reaper.retire(group)
    del group
    deadline = retired_at + 5
    while not dropped and time.monotonic() < deadline:
        time.sleep(0.01)
    assert dropped and dropped[0] - retired_at < 0.25


def test_an_object_nothing_else_holds_is_let_go_attribute_by_attribute() -> None:
    """A solve bucket holds its ten part graphs: dropped whole, its destructors would hold the GIL for all ten at
    once. The reaper opens an object that only it still holds, and lets go of what it holds one by one."""
    from tts_core.accel.graph_swap import Reaper

    class Bucket:  # stands for a solve bucket: its part graphs
        def __init__(self, graphs: list) -> None:
            self.graphs = graphs

    graphs, dropped = _finalized(3)
    reaper = Reaper()
    reaper.retire({"bucket": Bucket(graphs)})
    del graphs
    deadline = time.monotonic() + 5
    while len(dropped) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(dropped) == 3
    times = sorted(dropped)
    assert all(b - a >= Reaper.PAUSE_S * 0.5 for a, b in zip(times, times[1:])), "the bucket's graphs went at once"
