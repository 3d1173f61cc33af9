"""Play-from-URL (#34 item 2) on the worker's own app with the espeak engine: the real `curl` and a caching HTTP
client (requests + CacheControl) fetch prompts, sox opens the WAVs, and the worker's /metrics says how often the
engine was asked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import quote

import aiohttp
import pytest
import requests
from cachecontrol import CacheControl

from engine_service.api.context import TTS_API
from engine_service.api.settings import TtsApiSettings
from engine_service.api.signed_url import signed_url
from engine_service.server import WorkerSettings
from engines.base import SynthesisRequest
from tests.engine_service.api.api_server import AUTH, KEY, GatedEngine, serve, settings, until
from tests.engine_service.worker_link import serving

pytestmark = pytest.mark.timeout(60)

TEXT = "Press one for sales. Press two for support."


def worker(engine, **play_url):
    api = settings(play_url=play_url) if play_url else settings()
    return serving(engine, WorkerSettings(slots=8), api)


async def renders(base: str, metric: str = "tts_api_prompt_cache_misses_total") -> float:
    """How often the worker's prompt cache asked the engine (its misses), or another of its counts."""
    async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as response:
        text = await response.text()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(metric))


def play_url(base: str, text: str = TEXT, **params: str) -> str:
    query = "&".join(f"{name}={quote(value, safe='')}" for name, value in {"text": text, **params}.items())
    return f"{base}/v1/play.wav?{query}"


async def curl(*args: str) -> subprocess.CompletedProcess:
    return await asyncio.to_thread(subprocess.run, ["curl", "-sS", *args], capture_output=True, text=True,
                                   timeout=30)


def soxi(path: Path) -> dict[str, str]:
    fields = {"encoding": "-e", "rate": "-r", "channels": "-c", "samples": "-s"}
    return {name: subprocess.run(["soxi", flag, str(path)], capture_output=True, text=True, check=True)
            .stdout.strip() for name, flag in fields.items()}


async def engine_samples(engine, text: str) -> int:
    channel = engine.open_stream(SynthesisRequest(text=text, voice="en"))
    return sum([len(chunk) async for chunk in channel])


async def test_curl_fetches_twice_with_its_etag_and_the_engine_is_asked_once(espeak, tmp_path):
    etag_file, body = tmp_path / "etag", tmp_path / "prompt.wav"
    async with worker(espeak, max_age_s=3600) as base:
        url = play_url(base)
        fetches = [await curl("-D-", "-o", str(body), "-H", f"Authorization: Bearer {KEY}",
                              "--etag-save", str(etag_file), "--etag-compare", str(etag_file), url)
                   for _ in range(2)]
        assert await renders(base) == 1
    first, second = (fetch.stdout.lower() for fetch in fetches)
    assert first.startswith("http/1.1 200") and second.startswith("http/1.1 304")
    assert "cache-control: private, max-age=3600" in first and "content-type: audio/wav" in first
    assert f"content-length: {body.stat().st_size}" in first
    etag = etag_file.read_text().strip()
    assert f"etag: {etag}" in first and f"etag: {etag}" in second
    assert soxi(body)["encoding"] == "Signed Integer PCM"


async def test_a_caching_client_keeps_the_prompt_and_revalidates_it_by_etag(espeak):
    async with worker(espeak, max_age_s=0) as base:
        client = CacheControl(requests.Session())
        client.headers.update(AUTH)
        url = play_url(base, codec="pcmu")
        first = await asyncio.to_thread(client.get, url)
        again = await asyncio.to_thread(client.get, url)  # max-age 0: the client asks again with If-None-Match
        assert await renders(base) == 1
    assert first.status_code == again.status_code == 200
    assert again.content == first.content and again.headers["ETag"] == first.headers["ETag"]


async def test_a_fresh_prompt_in_a_caching_client_is_not_fetched_again(espeak):
    async with worker(espeak, max_age_s=600) as base:
        client = CacheControl(requests.Session())
        client.headers.update(AUTH)
        bodies = [(await asyncio.to_thread(client.get, play_url(base))).content for _ in range(3)]
        async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as response:
            metrics = await response.text()
    assert bodies[0] == bodies[1] == bodies[2]
    answered = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith('tts_worker_http_requests_total{code="200",endpoint="/v1/play.{file_type}"}'))
    assert answered == 1  # the client served the other two itself


@pytest.mark.parametrize(("codec", "rate", "encoding"), [
    ("pcm16", 8000, "Signed Integer PCM"),
    ("pcm16", 16000, "Signed Integer PCM"),
    ("pcm16", 24000, "Signed Integer PCM"),
    ("pcmu", 8000, "u-law"),
    ("pcma", 8000, "A-law"),
])
async def test_the_wav_opens_in_sox_with_its_codec_rate_and_length(espeak, tmp_path, codec, rate, encoding):
    expected = await engine_samples(espeak, TEXT) * rate / espeak.sample_rate
    path = tmp_path / "prompt.wav"
    async with worker(espeak) as base:
        done = await curl("-f", "-o", str(path), "-H", f"Authorization: Bearer {KEY}",
                          play_url(base, codec=codec, rate=str(rate)))
    assert done.returncode == 0, done.stderr
    info = soxi(path)
    assert (info["encoding"], info["rate"], info["channels"]) == (encoding, str(rate), "1")
    assert abs(int(info["samples"]) - expected) <= 0.02 * expected  # espeak's length varies by a few ms per run


async def test_raw_files_and_head_share_the_render(espeak):
    async with worker(espeak) as base, aiohttp.ClientSession(headers=AUTH) as client:
        url = f"{base}/v1/play.ulaw?text={quote(TEXT)}"
        async with client.head(url) as head:
            assert head.status == 200 and await head.read() == b""
        async with client.get(url) as got:
            body = await got.read()
            assert got.headers["Content-Type"] == "audio/basic"
            assert got.headers["ETag"] == head.headers["ETag"]
            assert int(head.headers["Content-Length"]) == len(body) > 8000  # over a second of 8 kHz u-law
        async with client.get(f"{base}/v1/play.sln?text={quote(TEXT)}&rate=16000") as sln:
            assert sln.headers["Content-Type"] == "audio/l16;rate=16000"
            assert abs(len(await sln.read()) / 2 - len(body) * 2) <= 0.02 * len(body) * 2
        assert await renders(base) == 2  # the ulaw once (HEAD, then GET from memory), the sln once
        assert await renders(base, 'tts_api_prompt_cache_hits_total{where="memory"}') == 1


async def test_many_asking_at_once_for_a_new_prompt_cost_one_render():
    engine = GatedEngine(chunks=3)
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        cache = server.app[TTS_API].prompt_cache

        async def fetch() -> bytes:
            async with client.get(f"{server.url}/v1/play.wav?text=hello") as response:
                assert response.status == 200
                return await response.read()

        fetches = [asyncio.create_task(fetch()) for _ in range(5)]
        await until(lambda: cache.hits["in_flight"] == 4)  # four wait on the first one's render
        engine.gate.set()
        bodies = await asyncio.gather(*fetches)
    assert len(engine.texts) == 1 and cache.misses == 1
    assert len(set(bodies)) == 1 and len(bodies[0]) == 44 + 3 * 800 * 2  # 300 ms at 8 kHz, 16-bit, true header


async def test_a_miss_is_rendered_unpaced_and_a_streamed_answer_paced():
    """A play-URL miss is collected whole before its answer, so its engine stream is not paced in real time
    (SynthesisRequest.paced False); POST /v1/tts streams to a listener as it comes and stays paced."""
    engine = GatedEngine(chunks=1)
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.get(f"{server.url}/v1/play.wav?text=hello") as response:
            assert response.status == 200 and len(await response.read()) == 44 + 800 * 2
        async with client.post(f"{server.url}/v1/tts", json={"text": "hello there"}) as response:
            assert response.status == 200 and await response.read()
    assert list(zip(engine.texts, engine.paced)) == [("hello", False), ("hello there", True)]


async def test_signed_url_plays_without_a_header_and_a_changed_one_is_refused(espeak):
    async with worker(espeak) as base:
        url = signed_url(base, "/v1/play.wav", {"text": TEXT, "codec": "pcma"}, "test", KEY, int(time.time()) + 60)
        good = await curl("-D-", "-o", os.devnull, url)
        assert good.stdout.startswith("HTTP/1.1 200")
        assert "Cache-Control: public, max-age=86400" in good.stdout
        tampered = {
            "text": url.replace("sales", "sailing"),
            "signature": url[:-4] + ("0000" if not url.endswith("0000") else "1111"),
            "path": url.replace("/v1/play.wav", "/v1/play.alaw").replace("codec=pcma&", ""),
            "key": url.replace("key=test", "key=other"),
            "expiry pushed": url.replace("exp=", "exp=9"),
        }
        for what, bad in tampered.items():
            refused = await curl("-w", "\n%{http_code}", bad)
            body, _, status = refused.stdout.rpartition("\n")
            assert status == "403", what
            assert '"error": "bad_signature"' in body, what
        assert await renders(base) == 1


async def test_an_expired_or_unknown_key_url_is_refused(espeak):
    async with worker(espeak) as base, aiohttp.ClientSession() as client:
        expired = signed_url(base, "/v1/play.wav", {"text": TEXT}, "test", KEY, int(time.time()) - 1)
        unknown = signed_url(base, "/v1/play.wav", {"text": TEXT}, "nobody", KEY, int(time.time()) + 60)
        too_far = signed_url(base, "/v1/play.wav", {"text": TEXT}, "test", KEY, int(time.time()) + 400 * 86400)
        hostile = expired.replace("exp=", "exp=" + "9" * 5000)
        for url, words in ((expired, "exp: the URL expired"), (unknown, "key: no API key of that name"),
                           (too_far, "max_signed_ttl_s"), (hostile, "exp: missing or not a Unix time")):
            async with client.get(url) as response:
                assert response.status == 403
                assert words in (await response.json())["message"]
        async with client.get(play_url(base)) as unsigned:
            assert unsigned.status == 401  # neither a signature nor a key


async def test_the_cli_mints_a_url_that_plays(espeak, tmp_path):
    config = tmp_path / "gateway.yaml"
    config.write_text(f'tts_api:\n  api_keys:\n    - {{name: ivr, key: "{KEY}"}}\n')
    async with serving(espeak, WorkerSettings(), TtsApiSettings.from_mapping(
            {"api_keys": [{"name": "ivr", "key": KEY}]})) as base:
        minted = subprocess.run(
            [sys.executable, "-m", "engine_service.api.sign", "--config", str(config), "--key", "ivr",
             "--base-url", base, "--text", "Goodbye. Thank you.", "--codec", "pcmu", "--ttl", "1h"],
            capture_output=True, text=True, timeout=30)
        assert minted.returncode == 0, minted.stderr
        url = minted.stdout.strip()
        assert KEY not in url and url.split("?")[0].endswith("/v1/play.wav") and "%2E" in url
        path = tmp_path / "bye.wav"
        assert (await curl("-f", "-o", str(path), url)).returncode == 0
    assert soxi(path)["encoding"] == "u-law"
    for_asterisk = subprocess.run(
        [sys.executable, "-m", "engine_service.api.sign", "--config", str(config), "--key", "ivr", "--base-url",
         "https://tts.example.com", "--text", "Goodbye.", "--asterisk"], capture_output=True, text=True, timeout=30)
    assert for_asterisk.returncode == 0 and "&" not in for_asterisk.stdout
    assert for_asterisk.stdout.count("\\;") == 3  # text, exp, key, then sig: each ';' escaped for extensions.conf


@pytest.mark.parametrize(("query", "status", "words"), [
    ("voice=en", 400, "text: required"),
    ("text=hi&sample_rate=8000", 400, "sample_rate: unknown parameter"),
    ("text=hi&rate=44100", 400, "rate: sample_rate must be one of"),
    ("text=hi&codec=pcmu&rate=16000", 400, "pcmu is defined at 8000 Hz only"),
    ("text=hi&codec=opus", 400, "codec: unknown codec"),
    ("text=hi&voice=klingon", 400, "voice: unknown voice"),
    ("text=hi&text=ho", 400, "text: given twice"),
    ("text=hi&rate=%C2%B2", 400, "rate: sample_rate must be one of"),  # '²' is a digit to str.isdigit
    ("text=hi&rate=" + "9" * 5000, 400, "rate: sample_rate must be one of"),
])
async def test_bad_play_urls_name_the_parameter(espeak, query, status, words):
    async with serve(espeak) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.get(f"{server.url}/v1/play.wav?{query}") as response:
            assert response.status == status
            assert words in (await response.json())["message"]


async def test_a_failed_render_is_a_500_kept_nowhere_and_a_full_engine_a_503():
    engine = GatedEngine(chunks=2, fail_after_first=True)
    engine.gate.set()
    async with serve(engine) as server, aiohttp.ClientSession(headers=AUTH) as client:
        api = server.app[TTS_API]
        for attempt in (1, 2):  # not cached: the second asks the engine again
            async with client.get(f"{server.url}/v1/play.wav?text=hello") as response:
                assert response.status == 500
                assert (await response.json())["error"] == "synthesis_failed"
            assert len(engine.texts) == attempt and api.slots.in_use("test") == 0
    async with serve(GatedEngine(admit=False), settings(admission_timeout_s=0.2)) as server, \
            aiohttp.ClientSession(headers=AUTH) as client:
        async with client.get(f"{server.url}/v1/play.wav?text=hello") as response:
            assert response.status == 503 and response.headers["Retry-After"] == "1"


async def test_asterisks_url_form_and_revalidation(espeak):
    """Playback() splits at '&', so its URL separates parameters with ';'; when max-age passes,
    res_http_media_cache asks again with HEAD and If-None-Match and keeps its file on a 304."""
    async with worker(espeak) as base, aiohttp.ClientSession() as client:
        url = signed_url(base, "/v1/play.wav", {"text": TEXT, "rate": "8000"}, "test", KEY, int(time.time()) + 60,
                         separator=";")
        assert "&" not in url
        async with client.get(url) as got:
            assert got.status == 200 and got.headers["Content-Type"] == "audio/wav"
            etag = got.headers["ETag"]
        async with client.head(url, headers={"If-None-Match": etag}) as revalidated:
            assert revalidated.status == 304 and revalidated.headers["ETag"] == etag
        async with client.head(url, headers={"If-None-Match": '"something-else"'}) as changed:
            assert changed.status == 200
        assert await renders(base) == 1
