"""The cosyvoice2 engine end to end on the tiny golden model (random weights, CPU).

Random weights never say "stop" early, so requests force their speech-token count with the
`min_tokens`/`max_tokens` options; chunk sizes then follow from the schedule alone: with the golden
voice's 50 prompt tokens, the first chunk renders 25 tokens (25 x 2 mel frames x 480 samples, less
the 3840 samples HiFT holds back), later ones 50 tokens, the last one what is left.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine_service import protocol
from engine_service.server import WorkerSettings
from engines.base import (EmptyText, EngineUnavailable, SynthesisFailed, SynthesisRefused, SynthesisRequest,
                          UnknownVoice)
from engines.cosyvoice2 import CosyVoice2Engine
from engines.remote import RemoteEngine
from gateway.worker_report import workers_report
from tests.engine_service.worker_link import TOKEN, serving
from tts_core.voices import Voice

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960  # 2 mel frames x 480 samples at 24 kHz


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path):
    torch.set_num_threads(1)
    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", dtype="auto", max_batch=2, max_len=1024,
                              seed=1)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


def _request(tokens: int, text: str = "Hello there.", voice: str = VOICE) -> SynthesisRequest:
    return SynthesisRequest(text=text, voice=voice, options={"min_tokens": tokens, "max_tokens": tokens})


async def _collect(channel, events: list | None = None, name: str = "") -> list[np.ndarray]:
    chunks = []
    async for chunk in channel:
        chunks.append(chunk)
        if events is not None:
            events.append((name, "chunk"))
    if events is not None:
        events.append((name, "end"))
    return chunks


async def test_stream_follows_the_chunk_schedule(engine: CosyVoice2Engine) -> None:
    assert engine.warmup_s is not None and engine.warmup_s > 0
    chunks = await asyncio.wait_for(_collect(engine.open_stream(_request(78))), 60)
    assert [len(c) for c in chunks] == [25 * SAMPLES_PER_TOKEN - 3840, 50 * SAMPLES_PER_TOKEN,
                                        3 * SAMPLES_PER_TOKEN + 3840]
    audio = np.concatenate(chunks)
    assert all(c.dtype == np.float32 for c in chunks) and engine.sample_rate == 24_000
    assert len(audio) == 78 * SAMPLES_PER_TOKEN
    assert np.isfinite(audio).all()
    assert np.sqrt(np.mean(audio**2)) > 1e-3


async def test_two_streams_interleave(engine: CosyVoice2Engine) -> None:
    events: list[tuple[str, str]] = []
    a = engine.open_stream(_request(150, "First caller speaking."))
    b = engine.open_stream(_request(150, "Second caller speaking."))
    got = await asyncio.wait_for(asyncio.gather(_collect(a, events, "a"), _collect(b, events, "b")), 60)
    first_end = min(events.index(("a", "end")), events.index(("b", "end")))
    assert ("a", "chunk") in events[:first_end] and ("b", "chunk") in events[:first_end]
    assert [sum(map(len, chunks)) for chunks in got] == [150 * SAMPLES_PER_TOKEN] * 2


async def test_cancel_frees_the_slot_for_a_third_request(engine: CosyVoice2Engine) -> None:
    long_a = engine.open_stream(_request(600))
    long_b = engine.open_stream(_request(600))
    await asyncio.wait_for(anext(long_a), 30)
    long_a.cancel()  # both slots (max_batch=2) were taken; this one must free at once
    events: list[tuple[str, str]] = []
    third = asyncio.ensure_future(_collect(engine.open_stream(_request(60)), events, "third"))
    rest_b = asyncio.ensure_future(_collect(long_b, events, "b"))
    chunks = await asyncio.wait_for(third, 60)
    assert sum(map(len, chunks)) == 60 * SAMPLES_PER_TOKEN
    assert ("b", "end") not in events  # the third ran while b was still speaking
    long_b.cancel()
    rest_b.cancel()


async def test_a_new_text_is_normalised_off_the_event_loop_and_a_spoken_one_is_queued_at_once(
        engine: CosyVoice2Engine) -> None:
    """The text frontend (~10 ms for a long prompt) must not stall the loop that carries every other stream's
    audio: a text not seen before is normalised on the frontend thread and its stream admitted after; a prompt
    spoken before is a look-up, queued and admitted before open_stream returns."""
    frontend = engine.pipeline.frontend
    threads: list[str] = []
    original = type(frontend).__call__

    def recording(self, text):
        threads.append(threading.current_thread().name)
        return original(self, text)

    text = "A prompt this engine has never spoken before, number 7."
    assert not frontend.knows(text)
    type(frontend).__call__ = recording
    try:
        new = engine.open_stream(_request(40, text))
        await asyncio.wait_for(new.admitted(), 30)
        assert len(threads) == 1 and threads[0].startswith("cosyvoice2-frontend")
        assert sum(map(len, await asyncio.wait_for(_collect(new), 60))) == 40 * SAMPLES_PER_TOKEN
        again = engine.open_stream(_request(40, text))
        assert threads[1] == threading.current_thread().name  # remembered: no thread hop
        await asyncio.wait_for(again.admitted(), 0.001)  # admitted already
        assert sum(map(len, await asyncio.wait_for(_collect(again), 60))) == 40 * SAMPLES_PER_TOKEN
    finally:
        type(frontend).__call__ = original


async def test_a_prepared_prompt_is_queued_at_its_first_call(engine: CosyVoice2Engine) -> None:
    """The gateway prepares its configured prompts at start, so the first caller of each does not wait for the
    text frontend; a text that cannot be spoken does not stop the others from being prepared."""
    prompts = ["Welcome to the prepared line, caller number 12.", "... !", "A second prepared prompt."]
    assert not any(engine.pipeline.frontend.knows(text) for text in prompts)
    await engine.prepare(prompts)
    assert all(engine.pipeline.frontend.knows(text) for text in prompts)
    first = engine.open_stream(_request(40, prompts[0]))
    await asyncio.wait_for(first.admitted(), 0.001)  # admitted before open_stream returned: no frontend to wait for
    assert sum(map(len, await asyncio.wait_for(_collect(first), 60))) == 40 * SAMPLES_PER_TOKEN


async def test_close_settles_every_stream_whose_text_was_still_waiting(tiny_model_dir: Path) -> None:
    """Streams opened just before close(): each is admitted then fails, or is refused; none waits forever."""
    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=2, max_len=1024, warmup=False,
                              compile_flow=False, compile_hift=False, slot_attention=False, first_chunk_lanes=1)
    await engine.start()
    streams = [engine.open_stream(_request(300, f"Caller number {i} is waiting in line.")) for i in range(6)]
    await engine.close()
    for stream in streams:
        try:
            await asyncio.wait_for(stream.admitted(), 30)
        except (EngineUnavailable, SynthesisRefused):
            continue
        with pytest.raises(SynthesisFailed):
            await asyncio.wait_for(_collect(stream), 30)


def test_validate_refuses_unknown_voice_and_empty_text(engine: CosyVoice2Engine) -> None:
    assert VOICE in engine.voices() and engine.default_voice == VOICE
    with pytest.raises(UnknownVoice):
        engine.validate(SynthesisRequest(text="hi", voice="nobody"))
    with pytest.raises(EmptyText):
        engine.validate(SynthesisRequest(text="   ", voice=VOICE))


async def test_a_text_of_only_punctuation_is_refused_before_the_call_is_answered(engine: CosyVoice2Engine) -> None:
    """ "... !" has nothing to speak: open_stream refuses it (a SynthesisRefused the gateway turns into a SIP
    rejection) instead of answering with a stream that ends silent."""
    with pytest.raises(SynthesisRefused, match="nothing to speak|no letters or digits"):
        engine.open_stream(SynthesisRequest(text="... !", voice=VOICE))


async def test_a_failing_job_fails_only_its_stream(engine: CosyVoice2Engine) -> None:
    good = engine.pipeline.voices.get(VOICE)
    # A voice whose prompt mel has the wrong width: the flow fails while rendering its first chunk.
    broken = Voice("broken", good.prompt_text, good.llm_prompt_speech_token, good.flow_prompt_speech_token,
                   good.prompt_speech_feat[:, :79], good.llm_embedding, good.flow_embedding)
    engine.pipeline.voices.add(broken)
    bad_stream = engine.open_stream(_request(100, voice="broken"))
    good_stream = engine.open_stream(_request(100))
    with pytest.raises(SynthesisFailed):
        await asyncio.wait_for(_collect(bad_stream), 60)
    chunks = await asyncio.wait_for(_collect(good_stream), 60)
    assert sum(map(len, chunks)) == 100 * SAMPLES_PER_TOKEN


async def test_close_fails_open_streams(tiny_model_dir: Path) -> None:
    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=1, max_len=1024, warmup=False,
                              compile_flow=False, compile_hift=False, slot_attention=False,
                              first_chunk_lanes=1)
    await engine.start()
    settings = engine.pipeline.scheduler.settings
    # the config keys reach the scheduler
    assert (settings.compile_flow, settings.compile_hift, settings.slot_attention) == (False, False, False)
    assert engine.pipeline.scheduler.renderer.first_lanes == ["first-0"]
    stream = engine.open_stream(_request(600))
    await asyncio.wait_for(anext(stream), 30)
    await engine.close()
    with pytest.raises(SynthesisFailed):
        await asyncio.wait_for(_collect(stream), 30)


async def _served_graphs(engine: CosyVoice2Engine) -> tuple[dict[str, float], dict]:
    """The engine in a real worker: its /metrics' graph samples, and what a gateway's /healthz says of it."""
    async with serving(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05)) as base:
        async with aiohttp.ClientSession() as session, session.get(f"{base}/metrics") as response:
            samples = {sample.name: sample.value for family in text_string_to_metric_families(await response.text())
                       for sample in family.samples if "graph" in sample.name}
        gateway = RemoteEngine(urls=[base.replace("http", "ws") + protocol.STREAM_PATH], token=TOKEN,
                               engine_name="cosyvoice2")
        await gateway.start()
        try:
            await gateway.wait_ready(10)
            return samples, workers_report(gateway.links, None)["workers"]
        finally:
            await gateway.close()


async def test_a_cpu_worker_is_at_full_speed_with_no_graphs_to_compile(engine: CosyVoice2Engine) -> None:
    # On CPU no tts-compile thread runs: nothing to wait for, so the worker says so from the start.
    samples, workers = await _served_graphs(engine)
    assert samples == {"tts_worker_graphs_compiled": 1.0, "tts_worker_graph_compile_failures_total": 0.0}
    assert [entry["speed"] for entry in workers.values()] == ["full"]


async def test_a_failed_compile_shows_in_the_workers_metrics_and_the_gateways_health(tiny_model_dir: Path) -> None:
    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=1, max_len=1024, warmup=False)
    await engine.start()
    try:
        # The tts-compile thread's body on a CPU model: its CUDA device cannot be entered, so it fails as a
        # compile that raises does, and the worker serves on.
        compile_thread = threading.Thread(target=engine.pipeline.scheduler.graph_compile.run)
        compile_thread.start()
        compile_thread.join(30)
        samples, workers = await _served_graphs(engine)
    finally:
        await engine.close()
    assert samples == {"tts_worker_graphs_compiled": 0.0, "tts_worker_graph_compile_failures_total": 1.0}
    (entry,) = workers.values()
    assert entry["ready"] and entry["speed"].startswith("slow: compiling its graphs failed")


def test_settings_errors_name_the_key(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="model_dir"):
        CosyVoice2Engine()
    with pytest.raises(ValueError, match="dtype"):
        CosyVoice2Engine(model_dir=str(tiny_model_dir), dtype="int8")
    with pytest.raises(ValueError, match="unknown key"):
        CosyVoice2Engine(model_dir=str(tiny_model_dir), batch=3)


def test_fast_path_is_on_for_cuda_and_off_for_cpu_by_default(tmp_path):
    from engines.cosyvoice2.settings import DEFAULT_GPU_ENCODER_TOKENS, CosyVoice2Settings

    auto = CosyVoice2Settings.from_config({"model_dir": str(tmp_path)})
    assert auto.fast_path("cpu") == (False, None)  # every encoder token: exact, official-equal flow
    assert auto.fast_path("cuda") == (True, DEFAULT_GPU_ENCODER_TOKENS)
    exact_on_gpu = CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_encoder_tokens": 0})
    assert exact_on_gpu.fast_path("cuda") == (True, None)
    assert CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_context_s": 10}).flow_context_frames == 500
    with pytest.raises(ValueError, match="engine.cosyvoice2.graphs"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "graphs": True}).fast_path("cpu")
    with pytest.raises(ValueError, match="flow_encoder_tokens"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_encoder_tokens": -1})
    with pytest.raises(ValueError, match="flow_context_s"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_context_s": 0})
    with pytest.raises(ValueError, match="engine.cosyvoice2.llm_fp8"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "llm_fp8": "yes"})
    assert not CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "compile_flow": False}).compile_flow
    with pytest.raises(ValueError, match="engine.cosyvoice2.compile_flow"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "compile_flow": "no"})
    with pytest.raises(ValueError, match="engine.cosyvoice2.compile_hift"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "compile_hift": 1})
    with pytest.raises(ValueError, match="engine.cosyvoice2.slot_attention"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "slot_attention": "on"})
    assert CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_context_int8": True}).flow_context_int8
    assert CosyVoice2Settings.from_config({"model_dir": str(tmp_path)}).shed_late_s == 0.5  # sheds unless told not to
    assert CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "shed_late_s": None}).shed_late_s is None
    assert CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "shed_late_s": 1}).shed_late_s == 1
    for bad in (0, -1.0, "1", True):
        with pytest.raises(ValueError, match="engine.cosyvoice2.shed_late_s"):
            CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "shed_late_s": bad})
    with pytest.raises(ValueError, match="engine.cosyvoice2.flow_context_int8"):
        CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "flow_context_int8": "yes"})
    for bad in (-1, 9, 2.5, "3", True):
        with pytest.raises(ValueError, match="engine.cosyvoice2.first_chunk_lanes"):
            CosyVoice2Settings.from_config({"model_dir": str(tmp_path), "first_chunk_lanes": bad})


async def test_a_runtime_behind_real_time_sheds_new_streams_until_it_catches_up(tiny_model_dir: Path) -> None:
    """shed_late_s: while a live stream's listener has been out of audio for longer than that, the engine has no
    free slot: the in-process gateway's watchdog and a worker's status (so a gateway over the wire) refuse new
    calls before they are answered, rather than stretch every call's speech with silence. Once no stream is that
    late, new streams are taken again. The stream is made late by its playout clock: its first chunk is dated
    10 s earlier, as if the listener had been playing since then (the tiny model on CPU has no overload to give)."""
    from engines.base import NoCapacity
    from gateway.engine_watchdog import EngineWatchdog, WatchdogSettings

    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=2, max_len=1024, seed=1,
                              warmup=False, shed_late_s=0.5)
    await engine.start()
    try:
        long = engine.open_stream(_request(600))
        await asyncio.wait_for(anext(long), 60)
        assert engine.health().accepting  # on time: a stream is taken
        (job,) = engine.pipeline.scheduler._active
        job.timings.first_chunk -= 10.0
        health = engine.health()
        assert not health.accepting and health.slots_free == 0 and "behind real time" in health.reason
        assert EngineWatchdog(engine, WatchdogSettings()).refusal().startswith("no_capacity: behind real time")
        async with serving(engine, WorkerSettings(token=TOKEN, slots=2, status_interval_s=0.05)) as base:
            gateway = RemoteEngine(urls=[base.replace("http", "ws") + protocol.STREAM_PATH], token=TOKEN,
                                   engine_name="cosyvoice2")
            await gateway.start()
            try:
                await gateway.wait_ready(10)
                assert gateway.health().slots_free == 0  # the worker says so in its status
                with pytest.raises(NoCapacity):
                    gateway.open_stream(_request(30))
            finally:
                await gateway.close()
        long.cancel()  # the late stream ends: nothing is behind any more
        deadline = asyncio.get_running_loop().time() + 10
        while not engine.health().accepting and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)
        assert engine.health().accepting
        chunks = await asyncio.wait_for(_collect(engine.open_stream(_request(30))), 60)
        assert sum(map(len, chunks)) == 30 * SAMPLES_PER_TOKEN
    finally:
        await engine.close()


async def test_fp8_lm_weights_stream_the_same_schedule(tiny_model_dir: Path) -> None:
    fp8 = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=1, max_len=512, seed=1,
                           warmup=False, llm_fp8=True)
    await fp8.start()
    try:
        from tts_core.accel.fp8_linear import Fp8Projection

        layer = fp8.pipeline.scheduler.lm.llm.model.model.layers[0]
        assert isinstance(layer.self_attn._qkv, Fp8Projection) and isinstance(layer.mlp._down, Fp8Projection)
        chunks = await asyncio.wait_for(_collect(fp8.open_stream(_request(78))), 60)
    finally:
        await fp8.close()
    assert [len(c) for c in chunks] == [25 * SAMPLES_PER_TOKEN - 3840, 50 * SAMPLES_PER_TOKEN,
                                        3 * SAMPLES_PER_TOKEN + 3840]
    assert np.isfinite(np.concatenate(chunks)).all()


async def test_fp16_speaks_the_golden_model_whose_flow_overflowed_it_before(tiny_model_dir: Path) -> None:
    # The tiny golden model's random weights drive the flow's residual stream to ~6.6e5, and a
    # convolution of it passed float16's 65504: every chunk was NaN and the engine refused to start.
    # Its estimator now carries that stream scaled down in float16 (tts_core/flow/residual_scale.py).
    fp16 = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", dtype="fp16", max_batch=1, max_len=512,
                            seed=1)
    await fp16.start()
    try:
        chunks = await asyncio.wait_for(_collect(fp16.open_stream(_request(78))), 60)
    finally:
        await fp16.close()
    audio = np.concatenate(chunks)
    assert np.isfinite(audio).all() and np.sqrt(np.mean(audio ** 2)) > 1e-4


async def test_a_dtype_whose_activations_overflow_is_refused_at_start(tiny_model_dir: Path, tmp_path: Path) -> None:
    # A model whose mel itself passes float16's 65504 (its final projection scaled up here): NaN
    # audio in fp16. The warm-up request meets it and the engine refuses to start, naming the
    # setting, instead of playing noise to callers.
    from tts_core.checkpoint import read_state_dict
    from tts_core.runtime import SynthesisError

    for item in tiny_model_dir.iterdir():
        if item.name != "flow.pt":
            (tmp_path / item.name).symlink_to(item)
    state = read_state_dict(tiny_model_dir / "flow.pt")
    for key in ("decoder.estimator.final_proj.weight", "decoder.estimator.final_proj.bias"):
        state[key] = state[key] * 1e5
    torch.save(state, tmp_path / "flow.pt")
    fp16 = CosyVoice2Engine(model_dir=str(tmp_path), device="cpu", dtype="fp16", max_batch=1, max_len=512, seed=1)
    with pytest.raises(SynthesisError, match=r"non-finite audio \(torch.float16\).*engine.cosyvoice2.dtype"):
        await fp16.start()
    assert fp16.pipeline is None
