"""bench/spoken_prompt.py: the SIP benches' prompt texts last as long as the engine speaks them. On the tiny golden
model (random weights, the full-size bench model's tokenizer) a sized text is spoken for the seconds it was sized to,
and a 30-s one gets a KV cache that holds it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from spoken_prompt import BenchPrompts  # noqa: E402

from tts_core.runtime import CollectingSink, CosyVoice2Pipeline  # noqa: E402

SAMPLE_RATE = 24_000


def _config(model_dir: Path, max_len: int = 768) -> dict:
    return {"engine": {"name": "cosyvoice2", "cosyvoice2": {"model_dir": str(model_dir), "max_len": max_len}}}


def test_the_random_model_speaks_a_sized_text_for_its_seconds(tiny_model_dir: Path) -> None:
    # The random LM never stops on its own: the text's 20 x tokens cap ends it, at the seconds asked (rounded up
    # to a token of text: 0.8 s).
    config = _config(tiny_model_dir)
    prompts = BenchPrompts(config)
    text = prompts.text(4.0, "bench prompt ")
    spoken_s = prompts.spoken_s["4 s bench prompt"]
    assert 4.0 <= spoken_s < 4.8
    sizing = prompts.fit(config)
    assert sizing["max_len_raised_to"] is None  # 4 s fits in 768 positions
    torch.set_num_threads(1)
    pipeline = CosyVoice2Pipeline.load(tiny_model_dir, max_batch=1, max_len=config["engine"]["cosyvoice2"]["max_len"])
    try:
        sink = CollectingSink()
        pipeline.synthesize(text, "golden_speaker", sink)
        audio = np.concatenate(sink.wait(120))
    finally:
        pipeline.close()
    assert len(audio) / SAMPLE_RATE == pytest.approx(spoken_s)


def test_a_30_s_prompt_raises_max_len_to_hold_it_and_chars_keeps_the_old_text(tiny_model_dir: Path) -> None:
    config = _config(tiny_model_dir)
    prompts = BenchPrompts(config)
    text = prompts.text(30.0, "bench prompt ")
    assert 30.0 <= prompts.spoken_s["30 s bench prompt"] < 32.0 and len(text) < 100  # the shortest such text: a token or two over
    sizing = prompts.fit(config)
    assert sizing["max_len_raised_to"] == 1024 == config["engine"]["cosyvoice2"]["max_len"]
    # --prompt-length chars: 60 ms a character, as the benches sized every engine's text before; nothing raised.
    old = _config(tiny_model_dir)
    chars = BenchPrompts(old, "chars")
    assert chars.text(30.0, "bench prompt ") == ("bench prompt " * 40)[:500]
    assert chars.fit(old)["max_len_raised_to"] is None and old["engine"]["cosyvoice2"]["max_len"] == 768
