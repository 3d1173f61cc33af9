"""Golden parity: tts_core.hift against the official HiFTGenerator and CosyVoice2 token2wav streaming.

Every size (frames, samples, cache lengths, window length) is read from the golden files, so any
golden set made the same way passes.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch

from tts_core.checkpoint import CheckpointMismatch, read_state_dict
from tts_core.hift import MEL_CACHE_FRAMES, HiftGenerator, HiftStream, load_hift, load_hift_checkpoint, speech_window
from tts_core.model_config import load_model_yaml


@pytest.fixture(scope="module")
def golden(golden_dir: Path) -> dict:
    return torch.load(golden_dir / "cases" / "hift.pt", weights_only=False)


@pytest.fixture(scope="module")
def vocoder(tiny_model_dir: Path) -> HiftGenerator:
    return load_hift(tiny_model_dir)


@pytest.fixture(scope="module")
def vocoder64(vocoder: HiftGenerator) -> HiftGenerator:
    return copy.deepcopy(vocoder).double()


def float32_tolerance(vocoder: HiftGenerator, vocoder64: HiftGenerator, mel: torch.Tensor,
                      source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode in float32 and float64; return (float32 wav, float64 wav) for tolerance setting.

    Why not 1e-4: with random weights exp(conv_post) runs into its 1e2 clip, so the waveform before
    the +-0.99 clamp swings by ~6 (median) to ~30 and ~90% of samples sit on the clamp. The float32
    ulp there is ~1e-6, and ~30 convolution layers plus the overlap-add of the ISTFT accumulate it
    to ~2e-3 at the samples that cross the clamp range: two float32 runs of the *same* function in
    a different summation order (ours vs PyTorch 2.11's kernels upstream) differ by that much. So
    the tolerance is measured, not guessed: the float32-vs-float64 deviation of this very input.
    A wrong function (slope, padding, window, stride) is off by O(0.1..1) on thousands of samples.
    """
    with torch.inference_mode():
        return vocoder.decode(mel, source), vocoder64.decode(mel.double(), source.double())


def assert_wav_parity(ours32: torch.Tensor, ours64: torch.Tensor, official32: torch.Tensor) -> None:
    assert ours32.shape == official32.shape
    noise = float((ours32.double() - ours64).abs().max())
    # The official float32 result must sit within one float32-rounding spread of the exact function
    # (x2 margin for a different kernel order), and ours within two such spreads of it.
    assert float((official32.double() - ours64).abs().max()) <= 2 * noise + 1e-5
    assert float((ours32 - official32).abs().max()) <= 3 * noise + 1e-5
    # The disagreement is rare, isolated rounding, not a shifted or scaled signal: tiny on average.
    assert float((ours32 - official32).abs().mean()) < 1e-4


def test_f0_golden_parity(vocoder: HiftGenerator, golden: dict) -> None:
    with torch.inference_mode():
        f0 = vocoder.predict_f0(golden["mel"])
    assert f0.shape == golden["f0"].shape
    # Five small convolutions and a linear head: float32 reordering stays ~1e-6 on values ~1.
    assert float((f0 - golden["f0"]).abs().max()) <= 1e-4


@pytest.mark.parametrize("mel_key, source_key, wav_key", [
    ("mel", "source", "wav_given_source"),
    ("stream_mel_a", "stream_src_a", "stream_wav_a"),
    ("stream_mel_b", "stream_src_b", "stream_wav_b"),
])
def test_decode_given_source_golden_parity(vocoder, vocoder64, golden, mel_key, source_key, wav_key) -> None:
    ours32, ours64 = float32_tolerance(vocoder, vocoder64, golden[mel_key], golden[source_key])
    assert_wav_parity(ours32, ours64, golden[wav_key])


def test_speech_window_golden_parity(vocoder: HiftGenerator, golden: dict) -> None:
    stream = HiftStream(vocoder)
    assert MEL_CACHE_FRAMES == golden["mel_cache_len"]
    assert stream.source_cache_samples == golden["source_cache_len"]
    window = speech_window(stream.source_cache_samples)
    assert window.dtype == torch.float64
    # Upstream builds it with np.hamming: bit-equal to the golden one.
    assert torch.equal(window, golden["speech_window"])
    assert torch.allclose(window, torch.hamming_window(window.shape[0], periodic=False, dtype=torch.float64),
                          rtol=0, atol=1e-12)


def official_assembly(wav_a: torch.Tensor, wav_b: torch.Tensor, window: torch.Tensor, cache: int):
    """What CosyVoice2Model.token2wav returns for a non-final chunk a then a final chunk b, given the
    raw vocoder outputs of each (b's mel already carries the 8-frame cache)."""
    first = wav_a[..., :-cache]
    faded = wav_b.clone()
    faded[..., :cache] = (wav_b[..., :cache].double() * window[:cache]
                          + wav_a[..., -cache:].double() * window[cache:]).float()
    return first, faded


def test_hift_stream_golden_parity(vocoder, vocoder64, golden) -> None:
    cache_frames, cache = golden["mel_cache_len"], golden["source_cache_len"]
    mel_a, mel_b = golden["stream_mel_a"], golden["stream_mel_b"]
    # The golden second chunk's mel starts with the first chunk's last cache frames.
    assert torch.equal(mel_b[..., :cache_frames], mel_a[..., -cache_frames:])
    new_b = mel_b[..., cache_frames:]

    # Replay the recorded draws. For chunk b, spoil the cached region of the fresh source: the
    # stream must overwrite it with chunk a's last source samples (upstream's cache_source).
    src_b = golden["stream_src_b"].clone()
    src_b[..., :cache] = 0.5
    stream = HiftStream(vocoder)
    out_a = stream.push(mel_a, finalize=False, source=golden["stream_src_a"])
    out_b = stream.push(new_b, finalize=True, source=src_b)

    spf = vocoder.cfg.samples_per_frame
    assert out_a.shape[-1] == mel_a.shape[-1] * spf - cache
    assert out_a.shape[-1] + out_b.shape[-1] == (mel_a.shape[-1] + new_b.shape[-1]) * spf

    window = golden["speech_window"]
    # Exactly the official cache/fade/trim logic applied to our own raw decodes ...
    with torch.inference_mode():
        raw_a = vocoder.decode(mel_a, golden["stream_src_a"])
        raw_b = vocoder.decode(mel_b, golden["stream_src_b"])
    exp_a, exp_b = official_assembly(raw_a, raw_b, window, cache)
    assert torch.equal(out_a, exp_a)
    assert torch.equal(out_b, exp_b)
    # ... and, within float32 parity (see float32_tolerance), to the official raw outputs.
    gold_a, gold_b = official_assembly(golden["stream_wav_a"], golden["stream_wav_b"], window, cache)
    for ours, official, mel, src in [(out_a, gold_a, mel_a, golden["stream_src_a"]),
                                     (out_b, gold_b, mel_b, golden["stream_src_b"])]:
        raw32, raw64 = float32_tolerance(vocoder, vocoder64, mel, src)
        noise = float((raw32.double() - raw64).abs().max())
        assert float((ours - official).abs().max()) <= 3 * noise + 1e-5

    with pytest.raises(RuntimeError):
        stream.push(new_b, finalize=True)


def test_inference_writes_cache_source_over_fresh_draw(vocoder: HiftGenerator, golden: dict) -> None:
    cache = golden["stream_src_a"][..., -golden["source_cache_len"]:]
    gen = torch.Generator().manual_seed(7)
    wav, source = vocoder.inference(golden["stream_mel_b"], cache_source=cache, generator=gen)
    assert source.shape == golden["stream_src_b"].shape
    assert wav.shape[-1] == source.shape[-1]
    assert torch.equal(source[..., :cache.shape[-1]], cache)
    # The rest is a fresh draw, not a copy of the golden one.
    assert not torch.equal(source[..., cache.shape[-1]:], golden["stream_src_b"][..., cache.shape[-1]:])


def _region_stats(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std())


def test_source_draw_statistics_match_golden(vocoder: HiftGenerator, golden: dict) -> None:
    """The noise is seed-dependent, so a fresh draw is compared by its distribution per region."""
    with torch.inference_mode():
        f0 = vocoder.predict_f0(golden["mel"])
        source = vocoder.draw_source(f0, torch.Generator().manual_seed(20261125))
        again = vocoder.draw_source(f0, torch.Generator().manual_seed(20261125))
        other = vocoder.draw_source(f0, torch.Generator().manual_seed(1))
    assert source.shape == golden["source"].shape
    assert torch.equal(source, again)  # the generator, not global RNG, decides the draw
    assert not torch.equal(source, other)
    assert float(source.abs().max()) <= 1.0  # tanh output

    voiced = (golden["f0"] > vocoder.cfg.nsf_voiced_threshold).repeat_interleave(
        vocoder.cfg.samples_per_frame, dim=-1)[:, None, :]
    assert torch.equal(voiced, (f0 > vocoder.cfg.nsf_voiced_threshold).repeat_interleave(
        vocoder.cfg.samples_per_frame, dim=-1)[:, None, :])
    for mask in (voiced, ~voiced):
        n = int(mask.sum())
        if n < 1000:
            continue  # too few samples for a statistic (random-weight goldens are all unvoiced)
        for reference in (golden["source"], golden["source_inference_seeded"]):
            ref_mean, ref_std = _region_stats(reference[mask])
            mean, std = _region_stats(source[mask])
            # Per-sample noise is i.i.d.: the mean of n samples has standard error std/sqrt(n); allow
            # 6 joint standard errors. The std estimate has relative error ~1/sqrt(2n); allow 5%.
            assert abs(mean - ref_mean) <= 6 * ref_std * (2 / n) ** 0.5 + 1e-6
            assert abs(std / ref_std - 1) <= 0.05
            for q in (0.01, 0.99):
                assert abs(float(source[mask].quantile(q)) - float(reference[mask].quantile(q))) <= 0.1 * ref_std


def test_weight_norm_fold_parity(tiny_model_dir: Path, vocoder: HiftGenerator, golden: dict) -> None:
    folded = load_hift(tiny_model_dir).fold_weight_norm()
    keys = folded.state_dict().keys()
    assert not any("parametrizations" in k for k in keys)
    assert "conv_pre.weight" in keys and "ups.0.weight" in keys
    with torch.inference_mode():
        assert torch.equal(folded.conv_pre.weight, vocoder.conv_pre.weight)
        # Same float32 weights and the same kernels afterwards, so bit-equal outputs.
        assert torch.equal(folded.predict_f0(golden["mel"]), vocoder.predict_f0(golden["mel"]))
        assert torch.equal(folded.decode(golden["mel"], golden["source"]),
                           vocoder.decode(golden["mel"], golden["source"]))


def _old_weight_norm_keys(state: dict) -> dict:
    out = {}
    for key, value in state.items():
        key = key.replace(".parametrizations.weight.original0", ".weight_g")
        key = key.replace(".parametrizations.weight.original1", ".weight_v")
        out[key] = value
    return out


@pytest.mark.parametrize("layout", ["parametrizations", "weight_g_v", "generator_prefix", "generator_prefix_g_v"])
def test_hift_key_layouts_load(tiny_model_dir: Path, tmp_path: Path, golden: dict, vocoder: HiftGenerator,
                               layout: str) -> None:
    state = read_state_dict(tiny_model_dir / "hift.pt")
    if "g_v" in layout:
        state = _old_weight_norm_keys(state)
        assert any(k.endswith(".weight_g") for k in state)
    if "prefix" in layout:
        state = {f"generator.{k}": v for k, v in state.items()}
    path = tmp_path / "hift.pt"
    torch.save(state, path)
    model = load_hift_checkpoint(load_model_yaml(tiny_model_dir / "cosyvoice2.yaml"), path)
    with torch.inference_mode():
        assert torch.equal(model.predict_f0(golden["mel"]), vocoder.predict_f0(golden["mel"]))


def test_hift_checkpoint_mismatch_names_the_key(tiny_model_dir: Path, tmp_path: Path) -> None:
    state = read_state_dict(tiny_model_dir / "hift.pt")
    del state["m_source.l_linear.weight"]
    path = tmp_path / "hift.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointMismatch, match="m_source.l_linear.weight"):
        load_hift_checkpoint(load_model_yaml(tiny_model_dir / "cosyvoice2.yaml"), path)


def test_load_hift_folded(tiny_model_dir: Path) -> None:
    model = load_hift(tiny_model_dir, fold=True)
    assert not any("parametrizations" in k for k in model.state_dict())
    assert np.prod(model.cfg.upsample_rates) * model.cfg.hop_len == model.cfg.samples_per_frame


def test_hift_stream_chunk_lengths_follow_official_token2wav(golden_dir: Path, tiny_model_dir: Path,
                                                              vocoder: HiftGenerator, golden: dict) -> None:
    """Fed the official fixed-hop schedule, the stream returns the official chunk lengths."""
    case = torch.load(golden_dir / "cases" / "token2wav_stream.pt", weights_only=False)
    config = load_model_yaml(tiny_model_dir / "cosyvoice2.yaml")
    hop, ratio = config["chunk_size"], config["token_mel_ratio"]
    lookahead = config["flow"]["pre_lookahead_len"]
    speaker = next(iter(torch.load(tiny_model_dir / "spk2info.pt", weights_only=False).values()))
    n_tokens = case["tokens"].shape[1]
    mel = golden["mel"]  # the flow's mel for these tokens; any mel of this length gives the same lengths
    assert mel.shape[-1] == n_tokens * ratio

    # Official loop: the first hop is padded so prompt + hop fills whole chunks; a chunk renders once
    # hop + lookahead unrendered tokens exist; the final call renders the rest.
    first_hop = hop + (-speaker["flow_prompt_speech_token"].shape[1]) % hop
    chunks, rendered, this_hop = [], 0, first_hop
    while n_tokens - rendered >= this_hop + lookahead:
        chunks.append((rendered, rendered + this_hop, False))
        rendered, this_hop = rendered + this_hop, hop
    chunks.append((rendered, n_tokens, True))

    stream = HiftStream(vocoder, torch.Generator().manual_seed(0))
    lengths = [stream.push(mel[..., a * ratio:b * ratio], finalize=last).shape[-1] for a, b, last in chunks]
    assert lengths == [c.shape[-1] for c in case["chunks"]]


def test_compiled_stages_keep_golden_parity(vocoder, vocoder64, golden) -> None:
    # What compile_hift does to a captured HiFT graph (accel/hift_graphs), on CPU: each stage's
    # residual blocks fused by inductor give the official waveform within the same float32
    # tolerance as the plain decode, for the full-utterance case and both streaming chunks (other
    # lengths: sizes are symbolic, so one compile serves them).
    from tts_core.accel.graph_capture import compiling_at_start_up
    from tts_core.accel.hift_graphs import compiled_mix

    mix = compiled_mix()
    for mel_key, source_key, wav_key in [("mel", "source", "wav_given_source"),
                                         ("stream_mel_a", "stream_src_a", "stream_wav_a"),
                                         ("stream_mel_b", "stream_src_b", "stream_wav_b")]:
        mel, source = golden[mel_key], golden[source_key]
        with torch.inference_mode(), compiling_at_start_up():
            compiled = vocoder.decode(mel, source, mix)
        _, ours64 = float32_tolerance(vocoder, vocoder64, mel, source)
        assert_wav_parity(compiled, ours64, golden[wav_key])
