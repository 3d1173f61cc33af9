"""Per-call cost of one 20 ms packet-clock tick: pop a frame, G.711-encode it, pack RTP, sendto.

Runs the real path: a MediaEngine on loopback, N calls each playing a long prompt, the shared
PacketClock driving them. Two marker subscribers bracket the calls on every tick, so the figure is
exactly the time the clock spends serving the calls (no resampling: the prompt is fed at 8 kHz, the
resampler runs when chunks arrive, not on the tick). A component breakdown for one frame follows.

Read `marginal_us` (the cost each extra call adds, from the slope against the 1-call row) for
capacity: a tick that follows 20 ms of idle pays a fixed ~0.1 ms of cold caches / CPU wake-up, which
dominates the 1-call row's `per_call_us`.

    python bench/bench_media_tick.py [--calls 1 100 500 1000] [--ticks 50]

Prints a table and writes bench/results/media_tick.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import socket
import statistics
import time
import timeit
from pathlib import Path

import numpy as np

from speech_audio import g711
from gateway.media.call_media import MediaEngine, MediaSettings
from gateway.media.playout import PlayoutBuffer
from gateway.media.rtp import pack_header

RESULTS = Path(__file__).resolve().parent / "results" / "media_tick.json"
TICK_BUDGET_S = 0.020


def _offer(port: int) -> str:
    return ("v=0\r\no=b 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {port} RTP/AVP 0\r\n")


async def _prompt(seconds: float):
    yield g711.float_to_pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * 8000)) / 8000))


async def measure(calls: int, ticks: int) -> dict:
    loop = asyncio.get_running_loop()
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)  # a phone that never reads: the kernel drops
    sink.bind(("127.0.0.1", 0))
    engine = MediaEngine(MediaSettings(rtp_port_min=31000, rtp_port_max=31000 + 4 * calls + 10,
                                       initial_playout_delay_ms=20, rtcp_interval_s=3600))
    await engine.start()
    starts: dict[int, float] = {}
    works: list[float] = []
    enough = loop.create_future()

    def tick_start(index: int, deadline: float) -> None:
        starts[index] = time.perf_counter()

    def tick_end(index: int, deadline: float) -> None:
        if index in starts:
            works.append(time.perf_counter() - starts[index])
        if len(works) >= ticks and not enough.done():
            enough.set_result(None)

    engine.clock.subscribe(tick_start)
    media = [await engine.open_call(f"bench-{i}", _offer(sink.getsockname()[1])) for i in range(calls)]
    plays = [asyncio.create_task(m.play(_prompt(ticks * 0.02 + 2.0))) for m in media]
    await asyncio.sleep(0.1)  # every call has its prompt buffered and is subscribed
    engine.clock.subscribe(tick_end)
    skipped_before = engine.clock.skipped_ticks
    await enough
    for task in plays:
        task.cancel()
    await asyncio.gather(*plays, return_exceptions=True)
    sent = sum(m.packets_sent for m in media)
    await engine.stop()
    sink.close()
    works.sort()
    median = statistics.median(works)
    return {
        "calls": calls, "ticks": len(works), "packets_sent": sent,
        "tick_median_ms": round(median * 1e3, 3),
        "tick_p99_ms": round(works[int(0.99 * (len(works) - 1))] * 1e3, 3),
        "per_call_us": round(median / calls * 1e6, 2),
        "budget_used_pct": round(100 * median / TICK_BUDGET_S, 1),
        "skipped_ticks": engine.clock.skipped_ticks - skipped_before,
    }


def components() -> dict:
    """One 160-sample frame through each step alone, in microseconds."""
    float_frame = (0.3 * np.sin(np.arange(160) / 3)).astype(np.float32)
    frame = g711.float_to_pcm16(float_frame)  # what the playout buffer holds
    buffer = PlayoutBuffer()
    buffer.push(np.tile(frame, 10_000), now=0.0)
    buffer.end_of_stream()
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    packet = bytes(172)
    addr = sink.getsockname()
    n = 5000
    result = {
        "pop_frame_us": timeit.timeit(buffer.pop_frame, number=n) / n * 1e6,
        "g711_encode_us": timeit.timeit(lambda: g711.encode(frame, "PCMU"), number=n) / n * 1e6,
        # Not on the tick: done once per chunk at push time. Shown for what it would cost per frame.
        "float_to_pcm16_off_tick_us": timeit.timeit(lambda: g711.float_to_pcm16(float_frame), number=n) / n * 1e6,
        "rtp_pack_us": timeit.timeit(lambda: pack_header(0, 1, 2, 3, False) + packet[12:], number=n) / n * 1e6,
        "sendto_us": timeit.timeit(lambda: sock.sendto(packet, addr), number=n) / n * 1e6,
    }
    sock.close()
    sink.close()
    return {k: round(v, 2) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 100, 500, 1000])
    parser.add_argument("--ticks", type=int, default=50)
    args = parser.parse_args()
    rows = [asyncio.run(measure(n, args.ticks)) for n in args.calls]
    base = min(rows, key=lambda r: r["calls"])
    for r in rows:
        extra = r["calls"] - base["calls"]
        r["marginal_us"] = round((r["tick_median_ms"] - base["tick_median_ms"]) * 1e3 / extra, 2) if extra else None
    parts = components()
    print(f"{'calls':>6} {'tick median ms':>15} {'tick p99 ms':>12} {'per call us':>12} {'marginal us':>12} "
          f"{'budget %':>9} {'skipped':>8}")
    for r in rows:
        print(f"{r['calls']:>6} {r['tick_median_ms']:>15} {r['tick_p99_ms']:>12} {r['per_call_us']:>12} "
              f"{str(r['marginal_us'] or '-'):>12} {r['budget_used_pct']:>9} {r['skipped_ticks']:>8}")
    print("one frame, step by step (us):", ", ".join(f"{k.removesuffix('_us')} {v}" for k, v in parts.items()))
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "host": {"machine": platform.machine(), "python": platform.python_version(),
                 "processor": platform.processor() or platform.machine()},
        "rows": rows, "components": parts,
    }, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
