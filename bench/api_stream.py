"""One open-loop request to the speech API (POST /v1/tts, 16-bit PCM streamed), timed as its client lives it.

`stream_request` sends the request, reads the chunked body to its end, and keeps each chunk's arrival time and
the audio received by then; the first audible frame (audible.py) is found as the bytes come. A refusal (any
status but 200, or no answer within the timeout) is an outcome, not an exception: an open-loop client counts
what it was refused. `stream_requests` runs a schedule of them in one process (each request its own
connection, as independent clients have).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from audible import FRAME_MS, first_audible_sample


@dataclass(frozen=True)
class PlannedRequest:
    index: int
    at_s: float  # seconds after the start
    text: str
    stop_after_s: float | None = None  # hang up this long after sending (the tail's requests), measured or not


@dataclass
class ApiResult:
    index: int
    status: int = 0
    reason: str = ""
    sent_s: float = 0.0  # time.time() the request left
    first_byte_s: float | None = None
    first_audible_s: float | None = None  # arrival of the chunk holding the first audible frame
    audible_audio_s: float = 0.0  # where in the audio that frame starts
    chunks: list[tuple[float, float]] = field(default_factory=list)  # (arrival time.time(), audio s so far)
    complete: bool = False  # the body ended normally


async def stream_request(session: aiohttp.ClientSession, url: str, planned: PlannedRequest, sample_rate: int,
                         timeout_s: float) -> ApiResult:
    result = ApiResult(planned.index)
    pending = bytearray()  # bytes not yet searched for the first audible frame
    searched = 0  # samples before `pending`
    frame_bytes = 2 * sample_rate * FRAME_MS // 1000
    received = 0
    result.sent_s = time.time()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/v1/tts", json={"text": planned.text, "format": "pcm_s16le",
                                                           "sample_rate": sample_rate}) as response:
                result.status = response.status
                if response.status != 200:
                    body = await response.read()
                    result.reason = body.decode(errors="replace")[:200]
                    return result
                async for data in response.content.iter_any():
                    now = time.time()
                    result.first_byte_s = result.first_byte_s or now
                    received += len(data)
                    result.chunks.append((now, received / (2 * sample_rate)))
                    if result.first_audible_s is None:
                        pending += data
                        whole = len(pending) // frame_bytes * frame_bytes
                        at = first_audible_sample(np.frombuffer(bytes(pending[:whole]), "<i2"), sample_rate)
                        if at is not None:
                            result.first_audible_s = now
                            result.audible_audio_s = (searched + at) / sample_rate
                        else:
                            searched += whole // 2
                            del pending[:whole]
                result.complete = True
    except TimeoutError:
        result.reason = "timeout"
    except aiohttp.ClientError as exc:
        result.reason = f"{type(exc).__name__}: {exc}"
    return result


async def stream_requests(url: str, key: str, schedule: list[PlannedRequest], start_at: float, sample_rate: int,
                          timeout_s: float) -> list[ApiResult]:
    """The schedule's requests, each sent at start_at + at_s (time.time()) whatever the earlier ones are doing."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)  # no pooling: each request a client of its own
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}, connector=connector) as session:
        tasks = []
        for planned in schedule:  # a send schedule, not media pacing
            await asyncio.sleep(max(0.0, start_at + planned.at_s - time.time()))
            limit = timeout_s if planned.stop_after_s is None else planned.stop_after_s
            tasks.append(asyncio.create_task(stream_request(session, url, planned, sample_rate, limit)))
        return list(await asyncio.gather(*tasks))
