"""The cosyvoice2 engine on a CosyVoice3 model directory (the tiny golden CosyVoice3 model, CPU): the family
is read from the directory, instruct / dialect are taken by name and refused on CosyVoice2, and a directory
that is not a usable model is refused at start in one line naming the problem.

Random weights never say "stop" early, so requests force their speech-token count (min/max_tokens).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.base import EngineSettingsError, SynthesisRequest, UnsupportedOption
from engines.cosyvoice2 import CosyVoice2Engine

VOICE = "golden_speaker"
SAMPLES_PER_TOKEN = 960


@pytest.fixture(scope="module")
def engine(tiny3_model_dir: Path):
    torch.set_num_threads(1)
    engine = CosyVoice2Engine(model_dir=str(tiny3_model_dir), device="cpu", max_batch=2, max_len=1024, seed=1)
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


def _request(tokens: int, **options: str) -> SynthesisRequest:
    return SynthesisRequest(text="Hello there.", voice=VOICE,
                            options={"min_tokens": tokens, "max_tokens": tokens, **options})


async def _audio(channel) -> np.ndarray:
    return np.concatenate([chunk async for chunk in channel])


async def test_a_cosyvoice3_directory_streams_with_and_without_a_dialect(engine: CosyVoice2Engine) -> None:
    assert engine.pipeline.family.version == 3 and engine.takes_instructs
    assert engine.pipeline.scheduler.settings.schedule.max_hop_tokens == 100  # CosyVoice3's official hop growth
    plain = await asyncio.wait_for(_audio(engine.open_stream(_request(60))), 60)
    dialect = await asyncio.wait_for(_audio(engine.open_stream(_request(60, dialect="sichuan"))), 60)
    instruct = await asyncio.wait_for(_audio(engine.open_stream(_request(60, instruct="slow"))), 60)
    for audio in (plain, dialect, instruct):
        assert audio.size == 60 * SAMPLES_PER_TOKEN and np.isfinite(audio).all()
        assert np.sqrt(np.mean(audio**2)) > 1e-3


def test_unknown_or_doubled_instructs_are_refused_with_400_naming_the_field(engine: CosyVoice2Engine) -> None:
    with pytest.raises(UnsupportedOption, match="dialect: 'klingon' is not one of cantonese") as refused:
        engine.validate(_request(10, dialect="klingon"))
    assert refused.value.sip_status == 400
    with pytest.raises(UnsupportedOption, match="give one"):
        engine.validate(_request(10, dialect="sichuan", instruct="happy"))


def test_a_cosyvoice2_model_refuses_an_instruct_with_400(tiny_model_dir: Path) -> None:
    torch.set_num_threads(1)
    engine = CosyVoice2Engine(model_dir=str(tiny_model_dir), device="cpu", max_batch=1, max_len=1024, warmup=False)
    asyncio.run(engine.start())
    try:
        assert engine.pipeline.scheduler.settings.schedule.max_hop_tokens == 50  # CosyVoice2's measured default
        with pytest.raises(UnsupportedOption, match="instruct: .* takes no instruct or dialect") as refused:
            engine.validate(_request(10, instruct="happy"))
        assert refused.value.sip_status == 400
        engine.validate(_request(10))  # the same request without it is fine
    finally:
        asyncio.run(engine.close())


@pytest.mark.parametrize("damage", ["no_flow", "two_yamls", "renamed_yaml"])
def test_a_directory_that_is_not_a_usable_model_is_refused_in_one_line(tiny3_model_dir: Path, tiny_model_dir: Path,
                                                                       tmp_path: Path, damage: str) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny3_model_dir, model)
    if damage == "no_flow":
        (model / "flow.pt").unlink()
        expected = "model file missing: .*flow.pt"
    elif damage == "two_yamls":
        shutil.copy(tiny_model_dir / "cosyvoice2.yaml", model / "cosyvoice2.yaml")
        expected = "holds both cosyvoice2.yaml and cosyvoice3.yaml"
    else:  # a CosyVoice3 yaml under CosyVoice2's name: the classes it builds disagree
        (model / "cosyvoice3.yaml").rename(model / "cosyvoice2.yaml")
        expected = "builds .*CosyVoice3LM, expected Qwen2LM"
    engine = CosyVoice2Engine(model_dir=str(model), device="cpu", max_batch=1, warmup=False)
    with pytest.raises(EngineSettingsError, match=expected) as refused:
        asyncio.run(engine.start())
    assert refused.value.key == "engine.cosyvoice2.model_dir" and "\n" not in str(refused.value)


def test_an_int8_flow_context_is_refused_for_cosyvoice3_in_one_line(tiny3_model_dir: Path) -> None:
    # CosyVoice3's DiT pool keeps keys and values in the model's dtype; the setting is CosyVoice2's pool's.
    engine = CosyVoice2Engine(model_dir=str(tiny3_model_dir), device="cpu", max_batch=1, flow_context_int8=True,
                              warmup=False)
    with pytest.raises(EngineSettingsError, match="CosyVoice2 models only") as refused:
        asyncio.run(engine.start())
    assert refused.value.key == "engine.cosyvoice2.flow_context_int8" and "\n" not in str(refused.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only: host memory is not checked")
def test_slots_and_context_too_large_for_the_gpu_are_refused_in_one_line_naming_the_keys(tiny3_model_dir: Path) -> None:
    # 1,000 slots x 300 s of kept frames: the tiny model's DiT pool alone ~225 GB, past any GPU (its LM's KV
    # rows stay ~0.1 GB), refused before the pool is allocated
    engine = CosyVoice2Engine(model_dir=str(tiny3_model_dir), device="cuda", max_batch=1000,
                              flow_context_s=300.0, warmup=False)
    with pytest.raises(EngineSettingsError, match=r"needs .* GiB but the device has .* GiB free") as refused:
        asyncio.run(engine.start())
    assert refused.value.key == "engine.cosyvoice2.max_batch" and "\n" not in str(refused.value)
