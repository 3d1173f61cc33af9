"""The worker's own Prometheus metrics, scraped over HTTP from a worker on a real socket while real links use it.

Every check compares a scrape before and after one thing happened, so a counter that did not move fails it.
"""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from engine_service import protocol
from engine_service.api.settings import TtsApiSettings
from engine_service.server import WorkerSettings, make_app
from engines.instant import InstantEngine
from tests.engine_service.api.api_server import GatedEngine, until
from tests.engine_service.worker_link import TOKEN, connect, frame_is, serving

FIRST_CHUNK_DELAY_S = 0.3
LINK = protocol.STREAM_PATH  # the route label of a gateway link's streams
API_KEY = "k" * 24


class Scrape:
    """One scrape's samples by (sample name, labels)."""

    def __init__(self, text: str) -> None:
        self.samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                        for family in text_string_to_metric_families(text) for sample in family.samples}

    def __call__(self, name: str, **labels: str) -> float:
        """The sample's value; 0 for a labelled series not yet created (a counter that never moved)."""
        return self.samples.get((name, tuple(sorted(labels.items()))), 0.0)


async def scrape(session: aiohttp.ClientSession, base: str) -> Scrape:
    async with session.get(f"{base}/metrics") as response:  # no token: see server._metrics
        assert response.status == 200 and response.content_type == "text/plain"
        return Scrape(await response.text())


@pytest.fixture
async def worker():
    engine = InstantEngine(chunk_ms=100, ms_per_char=20.0, max_duration_s=30.0,
                           first_chunk_delay_ms=FIRST_CHUNK_DELAY_S * 1000)
    await engine.start()
    api = TtsApiSettings.from_mapping({"api_keys": [{"name": "bot", "key": API_KEY, "max_streams": 4}]})
    async with serving(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05), api) as base:
        yield base
    await engine.close()


async def test_a_scrape_parses_and_reads_the_status_without_a_token(worker):
    async with aiohttp.ClientSession() as session:
        metrics = await scrape(session, worker)
        assert metrics("tts_worker_slots_total") == 2 and metrics("tts_worker_slots_free") == 2
        assert metrics("tts_worker_state", state="ready") == 1 and metrics("tts_worker_state", state="down") == 0
        assert metrics("tts_worker_streams_active") == 0 and metrics("tts_worker_links_open") == 0
        async with session.get(f"{worker}/v1/status") as response:
            assert response.status == 401  # the figures behind it still want the token


async def test_a_finished_stream_moves_opened_ended_and_the_first_chunk_histogram_by_one(worker):
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, worker)
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=1, text="a short prompt", voice="en"))
        await link.until(frame_is(protocol.End, 1))
        after = await scrape(session, worker)
    assert (after("tts_worker_streams_opened_total", route=LINK)
            - before("tts_worker_streams_opened_total", route=LINK)) == 1
    for outcome, moved in (("completed", 1), ("failed", 0), ("cancelled", 0)):
        assert (after("tts_worker_streams_ended_total", route=LINK, outcome=outcome)
                - before("tts_worker_streams_ended_total", route=LINK, outcome=outcome)) == moved
    assert (after("tts_worker_first_chunk_latency_seconds_count")
            - before("tts_worker_first_chunk_latency_seconds_count")) == 1
    # measured from the open frame: at least the engine's own first-chunk delay
    first_chunk_s = (after("tts_worker_first_chunk_latency_seconds_sum")
                     - before("tts_worker_first_chunk_latency_seconds_sum"))
    assert FIRST_CHUNK_DELAY_S <= first_chunk_s < 5
    assert after("tts_worker_first_audio_estimate_seconds") >= FIRST_CHUNK_DELAY_S  # learnt from that stream


@pytest.mark.parametrize("opens, reason", [
    ([protocol.Open(stream=n, text="x" * 1000, voice="en") for n in (1, 2, 3)], "no_capacity"),  # slots=2
    ([protocol.Open(stream=3, text="hi", voice="klingon")], "unknown_voice"),  # the engine's own refusal
])
async def test_a_refusal_moves_its_reasons_counter_only(worker, opens, reason):
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, worker)
        link = await connect(session, worker)
        for frame in opens:
            await link.send(frame)
        assert (await link.until(frame_is(protocol.Refused, 3))).reason == reason
        after = await scrape(session, worker)
    for known in protocol.REFUSAL_REASONS:
        moved = after("tts_worker_refusals_total", reason=known) - before("tts_worker_refusals_total", reason=known)
        assert moved == (1 if known == reason else 0), known


async def test_slots_free_and_links_follow_an_open_stream_and_a_dropped_link(worker):
    async with aiohttp.ClientSession() as session:
        link = await connect(session, worker)
        await link.send(protocol.Open(stream=1, text="x" * 1000, voice="en"))  # 20 s of audio: stays open
        await link.until(frame_is(protocol.Opened, 1))
        during = await scrape(session, worker)
        assert during("tts_worker_slots_free") == 1 and during("tts_worker_streams_active") == 1
        assert during("tts_worker_links_open") == 1
        await link.ws.close()  # its stream is cancelled with it
        other = await connect(session, worker)
        await other.until(lambda f: isinstance(f, protocol.Status) and f.slots_free == 2)
        after = await scrape(session, worker)
    assert after("tts_worker_slots_free") == 2 and after("tts_worker_streams_active") == 0
    assert after("tts_worker_links_open") == 1  # the other link
    assert (after("tts_worker_streams_ended_total", route=LINK, outcome="cancelled")
            - during("tts_worker_streams_ended_total", route=LINK, outcome="cancelled")) == 1


async def test_a_stream_that_breaks_mid_stream_counts_as_failed():
    engine = GatedEngine(chunks=3, fail_after_first=True)
    async with serving(engine, WorkerSettings(token=TOKEN, slots=2)) as base, aiohttp.ClientSession() as session:
        before = await scrape(session, base)
        link = await connect(session, base)
        await link.send(protocol.Open(stream=1, text="hello", voice="en"))
        await link.until(frame_is(protocol.Opened, 1))
        engine.gate.set()
        await link.until(frame_is(protocol.Failed, 1))
        after = await scrape(session, base)
    assert (after("tts_worker_streams_ended_total", route=LINK, outcome="failed")
            - before("tts_worker_streams_ended_total", route=LINK, outcome="failed")) == 1
    assert after("tts_worker_streams_ended_total", route=LINK, outcome="completed") == 0


async def test_the_speech_api_counts_requests_by_route_and_code_and_its_first_byte(worker):
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, worker)
        for key, code in ((API_KEY, 200), ("not-a-key-at-all", 401)):
            async with session.post(f"{worker}/v1/tts", headers={"Authorization": f"Bearer {key}"},
                                    json={"text": "hello from the api", "format": "pcm_s16le"}) as response:
                await response.read()
                assert response.status == code
        async with session.get(f"{worker}/no/such/page/{API_KEY}") as response:
            assert response.status == 404
        after = await scrape(session, worker)
    for code in ("200", "401"):
        assert (after("tts_worker_http_requests_total", endpoint="/v1/tts", code=code)
                - before("tts_worker_http_requests_total", endpoint="/v1/tts", code=code)) == 1
    assert (after("tts_worker_http_requests_total", endpoint="unmatched", code="404")
            - before("tts_worker_http_requests_total", endpoint="unmatched", code="404")) == 1
    assert not any(API_KEY in labels for _, labels in after.samples)  # a URL never becomes a label
    assert (after("tts_api_first_byte_latency_seconds_count", endpoint="/v1/tts")
            - before("tts_api_first_byte_latency_seconds_count", endpoint="/v1/tts")) == 1  # the 401 sent no audio
    first_byte_s = (after("tts_api_first_byte_latency_seconds_sum", endpoint="/v1/tts")
                    - before("tts_api_first_byte_latency_seconds_sum", endpoint="/v1/tts"))
    assert FIRST_CHUNK_DELAY_S <= first_byte_s < 5


async def test_the_speech_apis_streams_are_counted_with_the_links_labelled_by_route():
    """An API stream takes a worker slot like a call's: it counts in opened and ended too (issue #33)."""
    engine = GatedEngine(chunks=3)  # the first chunk at once, the rest only once the gate opens
    api = TtsApiSettings.from_mapping({"api_keys": [{"name": "bot", "key": API_KEY, "max_streams": 4}]})
    runner = web.AppRunner(make_app(engine, WorkerSettings(token=TOKEN, slots=2), api),
                           handler_cancellation=True)  # as engine_service/__main__.py runs it: a client gone ends it
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = "http://{}:{}".format(*runner.addresses[0][:2])
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
            before = await scrape(session, base)
            async with session.post(f"{base}/v1/jambonz/tts", json={"text": "left early"}) as response:
                assert response.status == 200
                await response.content.readany()  # the first audio, then the client goes away mid-stream
            await until(lambda: engine.channels[0].cancelled)
            engine.gate.set()
            async with session.post(f"{base}/v1/tts", json={"text": "all of it", "format": "pcm_s16le"}) as response:
                assert response.status == 200
                assert len(await response.read()) == 3 * 2400 * 2  # three 100 ms chunks at 24 kHz
            after = await scrape(session, base)
    finally:
        await runner.cleanup()

    def moved(name: str, **labels: str) -> float:
        return after(name, **labels) - before(name, **labels)

    assert moved("tts_worker_streams_opened_total", route="/v1/jambonz/tts") == 1
    assert moved("tts_worker_streams_ended_total", route="/v1/jambonz/tts", outcome="cancelled") == 1
    assert moved("tts_worker_streams_opened_total", route="/v1/tts") == 1
    assert moved("tts_worker_streams_ended_total", route="/v1/tts", outcome="completed") == 1
    assert moved("tts_worker_streams_opened_total", route=LINK) == 0
