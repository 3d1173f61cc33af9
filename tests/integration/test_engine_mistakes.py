"""Settings only the engine can check (a voice espeak-ng lacks, `device: cuda` on a host without one, a default
voice the model has not, a model directory missing a file), as `serve` meets them in both arrangements: in-process (engine.workers: 0) and in a
supervised worker (engine.workers: 1). Each is one line naming the key and the value, exit 2, no traceback
(issue #33 item 3)."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from serve_process import start_serve

pytestmark = [pytest.mark.timeout(180)]


def _cosyvoice2(model_dir, **settings) -> dict:
    return {"name": "cosyvoice2", "cosyvoice2": {"model_dir": str(model_dir), "device": "cpu", "dtype": "fp32",
                                                 "default_voice": "golden_speaker", "max_batch": 2,
                                                 "warmup": False, **settings}}


def _mistakes(tiny_model_dir, model_without_flow=None) -> dict[str, tuple[dict, str]]:
    """name -> (engine block, what the last line must say)."""
    return {
        "cosyvoice3_no_flow": (_cosyvoice2(model_without_flow),
                               f"engine.cosyvoice2.model_dir: '{model_without_flow}' is not usable: model file "
                               f"missing: {model_without_flow}/flow.pt"),
        "espeak_voice": ({"name": "espeak", "espeak": {"voices": {"en": "xx-nope"}, "default_voice": "en"}},
                         "engine.espeak.voices.en: 'xx-nope' is not a voice of the espeak-ng data installed"),
        "espeak_default_voice": ({"name": "espeak", "espeak": {"voices": {"en": "en-us"}, "default_voice": "fr"}},
                                 "engine.espeak.default_voice: 'fr'"),
        "cosyvoice2_cuda": (_cosyvoice2(tiny_model_dir, device="cuda"),
                            "engine.cosyvoice2.device: 'cuda' requested but CUDA is not available"),
        "cosyvoice2_default_voice": (_cosyvoice2(tiny_model_dir, default_voice="nobody"),
                                     "engine.cosyvoice2.default_voice: 'nobody' is not a voice of"),
    }


@pytest.mark.parametrize("workers", [0, 1], ids=["in_process", "worker"])
@pytest.mark.parametrize("mistake", ["espeak_voice", "espeak_default_voice", "cosyvoice2_cuda",
                                     "cosyvoice2_default_voice", "cosyvoice3_no_flow"])
async def test_an_engine_mistake_is_one_line_naming_the_key_and_value_and_exit_2(tmp_path, tiny_model_dir,
                                                                                 tiny3_model_dir, mistake, workers):
    broken = tmp_path / "cosyvoice3_without_flow"  # a CosyVoice3 directory missing a file
    if mistake == "cosyvoice3_no_flow":
        shutil.copytree(tiny3_model_dir, broken, ignore=shutil.ignore_patterns("flow.pt"))
    engine, expected = _mistakes(tiny_model_dir, broken)[mistake]
    if engine["name"] == "cosyvoice2":
        torch = pytest.importorskip("torch")
        if mistake == "cosyvoice2_cuda" and torch.cuda.is_available():
            pytest.skip("this host has CUDA: device cuda is no mistake here")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"engine": {**engine, "workers": workers}}))
    gateway = await start_serve(tmp_path, config)
    rc = await gateway.process.wait()
    log = gateway.tail(200_000)
    assert rc == 2, log[-3000:]
    assert "Traceback" not in log
    last = log.strip().splitlines()[-1]
    assert last.startswith("cosyvoice-gateway: config error: ") and expected in last, last
    assert not any(_is_json(line) and json.loads(line).get("event") == "engine_worker_exited"
                   for line in log.splitlines())  # refused, not restarted


def _is_json(line: str) -> bool:
    return line.startswith("{")
