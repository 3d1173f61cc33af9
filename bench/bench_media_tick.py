"""Per-call cost of one 20 ms packet-clock tick: pop a frame, encode it (G.711 or G.722), pack RTP, sendto.

Runs the real path: a MediaEngine on loopback, N calls each playing a long prompt, the shared
PacketClock driving them, for each codec asked for (the SDP offer names it alone). Two marker subscribers
bracket the calls on every tick, so the figure is exactly the time the clock spends serving the calls (no
resampling: the prompt is fed at the codec's rate, the resampler runs when chunks arrive, not on the tick). A
component breakdown for one frame follows.

Read `cpu_us_per_packet` (the process's CPU time over the window divided by the packets sent: one call's
cost per 20 ms, everything included) for capacity. The bracketed tick (`tick_median_ms`, `marginal_us`)
covers only the calls of the phase slot the markers share since the clock spreads calls over slots.

    python bench/bench_media_tick.py [--calls 1 100 500 1000] [--ticks 50] [--codecs PCMU G722]

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
from gateway.media.codecs import CODECS, Codec, frame_encoder
from gateway.media.playout import PlayoutBuffer
from gateway.media.rtp import pack_header

RESULTS = Path(__file__).resolve().parent / "results" / "media_tick.json"
TICK_BUDGET_S = 0.020


def _offer(port: int, codec: Codec) -> str:
    return ("v=0\r\no=b 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
            f"m=audio {port} RTP/AVP {codec.payload_type}\r\na=rtpmap:{codec.payload_type} {codec.name}/8000\r\n")


async def _prompt(seconds: float, rate: int):
    """Line audio (int16) at the codec's rate, whole, as a cache hit hands it to play()."""
    yield g711.float_to_pcm16(0.3 * np.sin(2 * np.pi * 440 * np.arange(int(seconds * rate)) / rate))


async def measure(calls: int, ticks: int, codec: Codec) -> dict:
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
    media = [await engine.open_call(f"bench-{i}", _offer(sink.getsockname()[1], codec)) for i in range(calls)]
    assert {m.plan.codec for m in media} == {codec.name}
    plays = [asyncio.create_task(m.play(_prompt(ticks * 0.02 + 2.0, codec.audio_rate))) for m in media]
    await asyncio.sleep(0.1)  # every call has its prompt buffered and is subscribed
    engine.clock.subscribe(tick_end)
    skipped_before = engine.clock.skipped_ticks
    cpu_before, sent_before = time.process_time(), sum(m.packets_sent for m in media)
    await enough
    cpu_s, window_sent = time.process_time() - cpu_before, sum(m.packets_sent for m in media) - sent_before
    for task in plays:
        task.cancel()
    await asyncio.gather(*plays, return_exceptions=True)
    sent = sum(m.packets_sent for m in media)
    await engine.stop()
    sink.close()
    works.sort()
    median = statistics.median(works)
    return {
        "codec": codec.name, "calls": calls, "ticks": len(works), "packets_sent": sent,
        "tick_median_ms": round(median * 1e3, 3),
        "tick_p99_ms": round(works[int(0.99 * (len(works) - 1))] * 1e3, 3),
        "per_call_us": round(median / calls * 1e6, 2),
        "budget_used_pct": round(100 * median / TICK_BUDGET_S, 1),
        "skipped_ticks": engine.clock.skipped_ticks - skipped_before,
        # The whole process's CPU (clock, loop, encode, sendto) per packet sent = per call per 20 ms: this, not
        # the bracketed tick, is the capacity figure while the clock spreads calls over phase slots.
        "cpu_us_per_packet": round(cpu_s / max(window_sent, 1) * 1e6, 2),
    }


def components() -> dict:
    """One 20 ms frame through each step alone, in microseconds (G.722's frame is 320 samples)."""
    float_frame = (0.3 * np.sin(np.arange(160) / 3)).astype(np.float32)
    frame = g711.float_to_pcm16(float_frame)  # what the playout buffer holds
    wide_frame = g711.float_to_pcm16((0.3 * np.sin(np.arange(320) / 6)).astype(np.float32))
    g722 = frame_encoder("G722")
    buffer = PlayoutBuffer()
    buffer.push(np.tile(frame, 10_000), now=0.0)
    buffer.end_of_stream()
    prompt = np.tile(frame, 1500)  # 30 s at 8 kHz
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sink.bind(("127.0.0.1", 0))
    packet = bytes(172)
    addr = sink.getsockname()
    n = 5000
    result = {
        "pop_frame_us": timeit.timeit(buffer.pop_frame, number=n) / n * 1e6,
        "g711_encode_us": timeit.timeit(lambda: g711.encode(frame, "PCMU"), number=n) / n * 1e6,
        "g722_encode_us": timeit.timeit(lambda: g722(wide_frame), number=n) / n * 1e6,
        # Not on the tick: done once per chunk at push time. Shown for what it would cost per frame.
        "float_to_pcm16_off_tick_us": timeit.timeit(lambda: g711.float_to_pcm16(float_frame), number=n) / n * 1e6,
        "rtp_pack_us": timeit.timeit(lambda: pack_header(0, 1, 2, 3, False) + packet[12:], number=n) / n * 1e6,
        "sendto_us": timeit.timeit(lambda: sock.sendto(packet, addr), number=n) / n * 1e6,
        # Once per call, not per frame: a prompt cache hit (30 s, the whole prompt at once) into a call's buffer.
        "cache_hit_push_30s_us": timeit.timeit(lambda: PlayoutBuffer().push(prompt, now=0.0), number=200) / 200 * 1e6,
    }
    sock.close()
    sink.close()
    return {k: round(v, 2) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, nargs="+", default=[1, 100, 500, 1000])
    parser.add_argument("--ticks", type=int, default=50)
    parser.add_argument("--codecs", nargs="+", default=["PCMU", "G722"], choices=sorted(CODECS))
    args = parser.parse_args()
    rows = []
    for name in args.codecs:
        codec_rows = [asyncio.run(measure(n, args.ticks, CODECS[name])) for n in args.calls]
        base = min(codec_rows, key=lambda r: r["calls"])
        for r in codec_rows:
            extra = r["calls"] - base["calls"]
            r["marginal_us"] = round((r["tick_median_ms"] - base["tick_median_ms"]) * 1e3 / extra, 2) if extra else None
        rows += codec_rows
    parts = components()
    print(f"{'codec':>6} {'calls':>6} {'cpu us/packet':>14} {'tick median ms':>15} {'tick p99 ms':>12} "
          f"{'per call us':>12} {'marginal us':>12} {'budget %':>9} {'skipped':>8}")
    for r in rows:
        print(f"{r['codec']:>6} {r['calls']:>6} {r['cpu_us_per_packet']:>14} {r['tick_median_ms']:>15} "
              f"{r['tick_p99_ms']:>12} {r['per_call_us']:>12} "
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
