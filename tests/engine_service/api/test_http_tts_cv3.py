"""POST /v1/tts on a CosyVoice3 model (the real engine on the tiny golden CosyVoice3 model, CPU), with a real aiohttp
client over loopback: the audio streams, with no click at its start or end; `dialect` / `instruct` are taken by name,
an unknown name or one sent to a CosyVoice2 model is a 400 unsupported_option.

Click check: the largest sample-to-sample jump in the first and last 20 ms of the stream, counting the step from
and to the silence around it, against the largest jump in the rest of the stream. A click is an edge jump as large
as the loudest moment's; the tiny model's streams measure 0.05-0.09 (README, "CosyVoice3").
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch

from engines.cosyvoice2 import CosyVoice2Engine
from tests.engine_service.api.api_server import AUTH, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
from edge_click import edge_jump_ratio  # noqa: E402  (bench/bench_cv3_dtypes.py measures the GPU's streams alike)

pytestmark = pytest.mark.timeout(120)

RATE = 24_000
CLICK_RATIO_MAX = 0.5


def _engine(model_dir: Path) -> CosyVoice2Engine:
    torch.set_num_threads(1)
    engine = CosyVoice2Engine(model_dir=str(model_dir), device="cpu", max_batch=2, max_len=1024, seed=1,
                              warmup=False, default_voice="golden_speaker")
    asyncio.run(engine.start())
    return engine


@pytest.fixture(scope="module")
def cv3(tiny3_model_dir: Path):
    engine = _engine(tiny3_model_dir)
    yield engine
    asyncio.run(engine.close())


async def _post(url: str, body: dict) -> tuple[int, bytes, dict]:
    async with aiohttp.ClientSession(headers=AUTH) as client, client.post(f"{url}/v1/tts", json=body) as response:
        return response.status, await response.read(), dict(response.headers)


async def test_the_speech_api_streams_cosyvoice3_audio_without_edge_clicks(cv3) -> None:
    async with serve(cv3) as server:
        status, body, headers = await _post(server.url, {"text": "Hello there, welcome to the service line.",
                                                         "format": "pcm_s16le", "sample_rate": RATE})
    assert status == 200 and headers["Transfer-Encoding"] == "chunked"
    audio = np.frombuffer(body, dtype="<i2").astype(np.float64) / 32768
    assert audio.size > RATE // 2 and np.sqrt(np.mean(audio**2)) > 0.01
    ratio = edge_jump_ratio(audio, RATE)
    print(f"edge click ratio {ratio:.3f} over {audio.size / RATE:.2f} s")  # the figure the README quotes
    assert ratio <= CLICK_RATIO_MAX


async def test_a_dialect_is_spoken_and_an_unknown_one_is_a_400(cv3) -> None:
    async with serve(cv3) as server:
        status, body, _ = await _post(server.url, {"text": "您好，欢迎致电。", "dialect": "sichuan",
                                                   "format": "pcm_s16le"})
        assert status == 200 and len(body) > RATE  # half a second of 16-bit audio at least
        status, body, _ = await _post(server.url, {"text": "hello", "dialect": "klingon"})
    assert status == 400
    assert b'"unsupported_option"' in body and b"dialect: 'klingon' is not one of" in body


async def test_a_cosyvoice2_model_answers_an_instruct_with_400(tiny_model_dir: Path) -> None:
    engine = await asyncio.to_thread(_engine, tiny_model_dir)
    try:
        async with serve(engine) as server:
            status, body, _ = await _post(server.url, {"text": "hello", "instruct": "happy"})
    finally:
        await engine.close()
    assert status == 400
    assert b'"unsupported_option"' in body and b"takes no instruct or dialect" in body


async def test_the_bot_websocket_speaks_every_sentence_in_the_dialect_it_opened_with(cv3) -> None:
    async with serve(cv3) as server, aiohttp.ClientSession(headers=AUTH) as client:
        async with client.ws_connect(f"{server.ws_url}/v1/tts/ws?dialect=sichuan&format=pcm_s16le") as ws:
            assert (await ws.receive_json(timeout=30))["type"] == "ready"
            await ws.send_json({"type": "text", "text": "您好，欢迎致电。"})
            await ws.send_json({"type": "flush"})
            audio = b""
            while (message := await ws.receive(timeout=60)).type == aiohttp.WSMsgType.BINARY:
                audio += message.data
            assert message.json()["type"] == "sentence_end" and len(audio) > RATE  # half a second at least
        async with client.get(f"{server.url}/v1/tts/ws?dialect=klingon") as refused:
            assert refused.status == 400 and (await refused.json())["error"] == "unsupported_option"
