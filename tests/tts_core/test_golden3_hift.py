"""CosyVoice3's causal HiFT against the official CausalHiFTGenerator (cases/hift.pt), tiny random model.

F0 (float64 inside, as the official code) and the deterministic source match bit for bit. The
waveform goes through exp() of a conv output (magnitudes up to the 1e2 clamp with random weights)
and an ISTFT, which amplifies float32 summation-order noise: a float64 run of the same model is
2e-4 from the official float32 output, ours 1.8e-4. WAV_TOL leaves room for that; a real defect (a
pad on the wrong side, a look-ahead off by one frame, linear instead of nearest phase) moves whole
stretches of samples by 1e-2 or more, which the mean check catches too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tts_core.checkpoint import read_state_dict
from tts_core.hift.causal import CausalHiftGenerator, load_causal_hift

WAV_TOL = 1e-3
WAV_MEAN_TOL = 1e-5


@pytest.fixture(scope="module")
def hift3(tiny3_model_dir: Path) -> CausalHiftGenerator:
    torch.set_num_threads(1)
    return load_causal_hift(tiny3_model_dir)


@pytest.fixture(scope="module")
def case(golden3_dir: Path) -> dict:
    return torch.load(golden3_dir / "cases" / "hift.pt", weights_only=False)


def _check_wav(wav: torch.Tensor, expected: torch.Tensor) -> None:
    assert wav.shape == expected.shape
    diff = (wav - expected).abs()
    assert diff.max().item() <= WAV_TOL
    assert diff.mean().item() <= WAV_MEAN_TOL


def test_settings_from_the_directory(hift3: CausalHiftGenerator, case: dict) -> None:
    cfg = hift3.cfg
    assert cfg.samples_per_frame == case["samples_per_frame"]
    assert hift3.conv_pre_look_right == case["conv_pre_look_right"]
    assert hift3.f0_predictor.look_ahead == case["f0_look_right"]
    assert list(cfg.upsample_rates) == case["upsample_rates"]
    assert (cfg.n_fft, cfg.hop_len, cfg.f0_cond_channels) == (case["istft_n_fft"], case["istft_hop"],
                                                             case["f0_cond_channels"])
    assert (cfg.nsf_voiced_threshold, cfg.nsf_alpha, cfg.nsf_sigma) == pytest.approx(
        (case["voiced_threshold"], case["sine_amp"], case["noise_std"]))


def test_fixed_noise_reproduced(hift3: CausalHiftGenerator, case: dict) -> None:
    src = hift3.m_source
    assert torch.equal(src.rand_ini, case["rand_ini"])
    assert list(src.sine_noise.shape) == case["sine_waves_shape"]
    head = case["sine_waves_head"]
    assert torch.equal(src.sine_noise[:, :head.size(1)], head)
    used = case["source"].size(2)
    assert src.sine_noise[:, :used].double().sum().item() == pytest.approx(case["sine_waves_sum_used"], abs=1e-6)


def test_f0_and_source(hift3: CausalHiftGenerator, case: dict) -> None:
    with torch.inference_mode():
        f0 = hift3.predict_f0(case["mel"])
        assert torch.equal(f0, case["f0"])
        assert torch.equal(hift3.source(f0), case["source"])


def test_decode_and_inference(hift3: CausalHiftGenerator, case: dict) -> None:
    with torch.inference_mode():
        _check_wav(hift3.decode(case["mel"], case["source"]), case["wav"])
        wav, source = hift3.inference(case["mel"], finalize=True)
    _check_wav(wav, case["wav"])
    assert torch.equal(source, case["source"])


def test_streaming_prefix(hift3: CausalHiftGenerator, case: dict) -> None:
    k = case["stream_k"]
    with torch.inference_mode():
        f0 = hift3.predict_f0(case["mel"][:, :, :k], finalize=False)
        wav, source = hift3.inference(case["mel"][:, :, :k], finalize=False)
    assert torch.equal(f0, case["stream_f0"])
    assert source.size(2) == case["stream_source_samples"]
    _check_wav(wav, case["stream_wav"])
    # A non-final call is a prefix of the final render (to float32 noise).
    _check_wav(wav, case["wav"][:, :wav.size(1)])


def _weight_g_v(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        out[key.replace(".parametrizations.weight.original1", ".weight_v")] = value
    return out


@pytest.mark.parametrize("layout", ["weight_g_v", "generator_prefix"])
def test_other_checkpoint_key_layouts(tiny3_model_dir: Path, tmp_path: Path, case: dict, layout: str) -> None:
    import shutil

    d = tmp_path / "m"
    shutil.copytree(tiny3_model_dir, d, copy_function=shutil.copyfile)
    state = read_state_dict(tiny3_model_dir / "hift.pt")
    if layout == "weight_g_v":
        state = _weight_g_v(state)
        assert any(k.endswith(".weight_g") for k in state)
    else:
        state = {f"generator.{k}": v for k, v in state.items()}
    torch.save(state, d / "hift.pt")
    hift = load_causal_hift(d)
    with torch.inference_mode():
        assert torch.equal(hift.predict_f0(case["mel"]), case["f0"])


def test_wrong_family_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="needs CosyVoice3"):
        load_causal_hift(tiny_model_dir)


def test_fixed_noise_of_the_full_size_model(golden3_dir: Path) -> None:
    """The recipe at the real sizes (the check file names its F0 cond_channels) reproduces the
    official check values: the noise depends on every size built before it."""
    from tts_core.hift.causal_source import NoiseRecipe, official_source_noise

    check = torch.load(golden3_dir / "full" / "hift_noise_full.pt", weights_only=False)
    rand_ini, noise = official_source_noise(NoiseRecipe(check["f0_cond_channels"]))
    assert torch.equal(rand_ini, check["rand_ini"])
    assert list(noise.shape) == check["sine_waves_shape"]
    assert torch.equal(noise[:, :check["sine_waves_head"].size(1)], check["sine_waves_head"])
    assert noise.double().sum().item() == pytest.approx(check["sine_waves_sum"], rel=1e-12)
