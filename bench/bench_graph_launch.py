"""How long a host thread waits in CUDA calls, and whether other threads' launches wait with it.

Under load the later lane's graph replays took 40 ms of host time at p95 (`bench_load.py
--host-waits`), and a first lane's plain kernel launches 11 ms on average, while a probe thread
got the GIL back within 0.4 ms (p95): the waits are in CUDA calls. On an otherwise idle GPU this
runs each scenario in the main thread while another thread launches one small kernel at a time on
a stream of its own, and reports the scenario's host time and the other thread's slowest launch:
  replay          replay a graph of ~`--work-ms` of kernels
  replay_again    replay it again while the first replay still runs
  sync            replay, then wait for the stream
  pageable_copy   replay, then copy its output to pageable host memory (`.cpu()`)
  pinned_copy     replay, then copy its output to pinned memory and wait for an event
  many_nodes      replay a graph of `--nodes` tiny kernels behind the busy graph on the same stream
--lifecycle instead: what a graph costs its replaying thread the first time, and what dropping a lane's
set of graphs costs the thread that drops it (a worker swaps its eager-module graphs for compiled ones
while serving; a lone call's first chunk on each lane paid ~27 ms more on the host than the next one):
  first / second replay   host ms of a fresh graph's first and second replay (`--nodes` kernels)
  after upload            the same, uploaded first (accel.graph_capture.upload; the upload's own ms)
  ..._gpu_ms              a fresh graph's first and second replay on the GPU (events on the replaying stream):
                          not uploaded, uploaded to the replaying stream, uploaded to another stream
  drop set                host ms to let go of `--set-graphs` such graphs sharing one memory pool
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch


def capture(stream: torch.cuda.Stream, body: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    graph = torch.cuda.CUDAGraph()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    with torch.cuda.graph(graph, stream=stream):
        out = body()
    torch.cuda.synchronize()
    return graph, out


def busy_body(work_ms: float) -> Callable[[], torch.Tensor]:
    """Matmuls that keep the GPU busy for about `work_ms`."""
    x = torch.randn(1024, 1024, device="cuda")
    for _ in range(5):  # cuBLAS's first calls set it up: not the time of one
        torch.tanh(x @ x)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        torch.tanh(x @ x)
    torch.cuda.synchronize()
    ops = max(1, int(work_ms / 1e3 / ((time.perf_counter() - t0) / 20)))

    def body() -> torch.Tensor:
        y = x
        for _ in range(ops):
            y = torch.tanh(y @ x)
        return y[:256]
    return body


def tiny_body(nodes: int) -> Callable[[], torch.Tensor]:
    z = torch.zeros(16, device="cuda")

    def body() -> torch.Tensor:
        for _ in range(nodes):
            z.add_(1)
        return z
    return body


def beside(action: Callable[[], None], side: torch.cuda.Stream) -> tuple[float, float]:
    """(ms the action took, ms of the other thread's slowest launch meanwhile)."""
    small = torch.zeros(1, device="cuda")
    launches: list[float] = []
    started, stop = threading.Event(), threading.Event()

    def launcher() -> None:
        with torch.cuda.stream(side):
            while not stop.is_set():
                t0 = time.perf_counter()
                small.add_(1)
                launches.append(time.perf_counter() - t0)
                started.set()
                time.sleep(0.0002)

    thread = threading.Thread(target=launcher)
    thread.start()
    started.wait()
    t0 = time.perf_counter()
    action()
    took = time.perf_counter() - t0
    stop.set()
    thread.join()
    torch.cuda.synchronize()
    return 1e3 * took, 1e3 * max(launches)


def lifecycle(nodes: int, set_graphs: int) -> dict:
    """First-replay and drop costs on the host (see the module docstring)."""
    from tts_core.accel.graph_capture import upload

    stream = torch.cuda.Stream()
    x = torch.zeros(1024, device="cuda")

    def body() -> torch.Tensor:  # allocates in the graph's pool, as the flow's graphs do
        y = x
        for _ in range(nodes):
            y = y + 1
        return y

    def timed(call: Callable[[], object]) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        torch.cuda.synchronize()
        return round(1e3 * took, 3)

    def on_gpu(graph: torch.cuda.CUDAGraph, where: torch.cuda.Stream) -> float:
        """The replay's time on `where`, between events recorded there around it."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        with torch.cuda.stream(where):
            start.record()
            graph.replay()
            end.record()
        end.synchronize()
        return round(start.elapsed_time(end), 3)

    out: dict = {"nodes": nodes, "set_graphs": set_graphs}
    for label, uploaded in (("plain", False), ("uploaded", True)):
        graph, _ = capture(stream, body)
        if uploaded:
            out["upload_ms"] = timed(lambda: upload(graph, stream))
            out["upload_done"] = upload(graph, stream)
        out[f"{label}_first_replay_ms"] = timed(graph.replay)
        out[f"{label}_second_replay_ms"] = timed(graph.replay)
    # The GPU's side (a lone call's first chunk on a fresh lane took 11-19 ms more of stream time after uploads
    # moved off the replaying thread): a fresh graph's first and second replay timed on the replaying stream,
    # not uploaded, uploaded to that stream, uploaded to another (the capture stream, as the runtime does).
    replaying = torch.cuda.Stream()
    for label, upload_to in (("plain", None), ("uploaded_same_stream", replaying), ("uploaded_other_stream", stream)):
        graph, _ = capture(stream, body)
        if upload_to is not None:
            upload(graph, upload_to)
            torch.cuda.synchronize()
        out[f"{label}_first_replay_gpu_ms"] = on_gpu(graph, replaying)
        out[f"{label}_second_replay_gpu_ms"] = on_gpu(graph, replaying)
    pool = torch.cuda.graph_pool_handle()
    graphs = []
    for _ in range(set_graphs):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            body()
        graphs.append(graph)
    torch.cuda.synchronize()
    out["drop_set_ms"] = timed(lambda: graphs.clear())
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work-ms", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=5000)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--out", type=Path)
    p.add_argument("--lifecycle", action="store_true", help="first-replay, upload and drop costs instead")
    p.add_argument("--set-graphs", type=int, default=40, help="--lifecycle: graphs in the dropped set")
    args = p.parse_args(argv)
    if args.lifecycle:
        report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                  "lifecycle": [lifecycle(n, args.set_graphs) for n in (args.nodes // 5, args.nodes)]}
        print(json.dumps(report, indent=1))
        if args.out:
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        return 0
    stream, side = torch.cuda.Stream(), torch.cuda.Stream()
    busy, busy_out = capture(stream, busy_body(args.work_ms))
    tiny, _ = capture(stream, tiny_body(args.nodes))
    pinned = torch.empty(busy_out.shape, dtype=busy_out.dtype, pin_memory=True)

    def with_stream(call: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            with torch.cuda.stream(stream):
                call()
        return run

    def pinned_copy() -> None:
        busy.replay()
        pinned.copy_(busy_out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()

    scenarios: dict[str, Callable[[], None]] = {
        "replay": busy.replay,
        "replay_again": lambda: (busy.replay(), busy.replay()),
        "sync": lambda: (busy.replay(), stream.synchronize()),
        "pageable_copy": lambda: (busy.replay(), busy_out.cpu()),
        "pinned_copy": pinned_copy,
        "many_nodes": lambda: (busy.replay(), tiny.replay()),
    }
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    busy.replay()
    torch.cuda.synchronize()
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "busy_graph_gpu_ms": round(1e3 * (time.perf_counter() - t0), 2), "nodes": args.nodes}
    beside(lambda: None, side)  # the launcher thread's first launch sets up its state: not measured
    print(f"busy graph: {report['busy_graph_gpu_ms']} ms on the GPU")
    print(f"{'scenario':>14} {'host ms':>9} {'other thread max launch ms (median, max)':>42}")
    for name, call in scenarios.items():
        runs = [beside(with_stream(call), side) for _ in range(args.repeats)]
        took, other = [r[0] for r in runs], [r[1] for r in runs]
        report[name] = {"host_ms": round(statistics.median(took), 3),
                        "other_max_launch_ms": round(statistics.median(other), 3),
                        "other_max_launch_ms_max": round(max(other), 3)}
        print(f"{name:>14} {statistics.median(took):>9.3f} {statistics.median(other):>20.3f} {max(other):>20.3f}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
