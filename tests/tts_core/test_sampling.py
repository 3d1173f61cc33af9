"""Repetition-aware sampling and the generation stop rules, checked by their distributions."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from tts_core.llm.sampling import RasSampler, SamplingConfig, nucleus_sample
from tts_core.llm.speech_lm import SpeechTokenLM
from tts_core.model_dir import ModelDir, load_speech_lm

DRAWS = 2000
SPEECH_TOKENS = 100  # toy vocabulary: ids 0..99 speech, 100..102 stop tokens


def _logp(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32).log()


def _gen(seed: int = 1234) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_top_k_bounds_a_flat_distribution() -> None:
    # 200 equally likely tokens: top_p 0.8 alone would keep 160, top_k keeps 25.
    logp = _logp([1 / 200] * 200)
    gen = _gen()
    seen = Counter(nucleus_sample(logp, top_p=0.8, top_k=25, generator=gen) for _ in range(DRAWS))
    # The stable sort keeps the first 25 ids among equals; all of them are reachable.
    assert set(seen) == set(range(25))


def test_top_p_bounds_a_peaked_distribution() -> None:
    probs = [0.5, 0.25, 0.125] + [0.125 / 97] * 97
    gen = _gen()
    seen = Counter(nucleus_sample(_logp(probs), top_p=0.8, top_k=25, generator=gen) for _ in range(DRAWS))
    # Mass taken before each: 0, .5, .75 (< .8, kept), .875 (stop): renormalised 4/7, 2/7, 1/7.
    assert set(seen) == {0, 1, 2}
    assert abs(seen[0] / DRAWS - 4 / 7) < 0.05
    assert abs(seen[2] / DRAWS - 1 / 7) < 0.05


def _dominant_token_logp() -> torch.Tensor:
    # Token 7 fills the nucleus alone (0.85 >= top_p) but the full distribution spreads 15% elsewhere.
    probs = [0.15 / (SPEECH_TOKENS - 1)] * SPEECH_TOKENS + [1e-9] * 3
    probs[7] = 0.85
    return _logp(probs)


@pytest.mark.parametrize(
    ("tau_r", "history", "falls_back"),
    [
        (0.1, [], False),
        (0.1, [7] + [3] * 10, False),  # the repeat left the 10-token window
        (0.1, [3] * 9 + [7], True),  # one repeat reaches 10 * 0.1
        (0.2, [3] * 9 + [7], False),  # 10 * 0.2 needs two
        (0.2, [3] * 8 + [7, 7], True),
    ],
)
def test_repetition_falls_back_to_the_full_distribution(tau_r: float, history: list[int], falls_back: bool) -> None:
    sampler = RasSampler(SamplingConfig(top_p=0.8, top_k=25, win_size=10, tau_r=tau_r), SPEECH_TOKENS)
    logp, gen = _dominant_token_logp(), _gen()
    picks = Counter(sampler.sample(logp, history, gen, allow_stop=True) for _ in range(DRAWS))
    others = (DRAWS - picks[7]) / DRAWS
    if falls_back:
        assert 0.10 < others < 0.20
    else:
        assert others == 0


def test_stop_tokens_are_rejected_until_allowed() -> None:
    probs = [0.3 / SPEECH_TOKENS] * SPEECH_TOKENS + [0.5, 0.1, 0.1]  # eos dominant, bistream ids too
    sampler = RasSampler(SamplingConfig(), SPEECH_TOKENS)
    logp, gen = _logp(probs), _gen()
    blocked = [sampler.sample(logp, [], gen, allow_stop=False) for _ in range(500)]
    assert max(blocked) < SPEECH_TOKENS
    allowed = [sampler.sample(logp, [], gen, allow_stop=True) for _ in range(500)]
    assert sum(t >= SPEECH_TOKENS for t in allowed) > 250


@pytest.fixture()
def lm(tiny_model_dir: Path) -> SpeechTokenLM:
    torch.set_num_threads(1)
    model = load_speech_lm(tiny_model_dir)
    model.setup_cache(max_batch=2, max_len=128)
    return model


@pytest.fixture(scope="module")
def sampler(tiny_model_dir: Path) -> RasSampler:
    md = ModelDir.open(tiny_model_dir)
    return RasSampler(md.sampling, int(md.llm_section["speech_token_size"]))


TEXT = [509, 16, 576]  # three text tokens: min_len 6, max_len 60


def _bias_stop_tokens(lm: SpeechTokenLM, value: float) -> None:
    with torch.no_grad():
        lm.llm_decoder.bias[lm.speech_token_size:] = value


def test_generation_stops_at_max_len(lm: SpeechTokenLM, sampler: RasSampler) -> None:
    _bias_stop_tokens(lm, -1e4)  # the model can never choose to stop
    tokens = list(lm.generate(TEXT, sampler, _gen()))
    assert len(tokens) == lm.length_bounds(len(TEXT))[1]
    assert max(tokens) < lm.speech_token_size


def test_generation_never_stops_before_min_len(lm: SpeechTokenLM, sampler: RasSampler) -> None:
    _bias_stop_tokens(lm, 1e4)  # the model wants to stop at every step
    tokens = list(lm.generate(TEXT, sampler, _gen()))
    assert len(tokens) == lm.length_bounds(len(TEXT))[0]


def test_same_seed_same_tokens(lm: SpeechTokenLM, sampler: RasSampler) -> None:
    _bias_stop_tokens(lm, -1e4)
    first = list(lm.generate(TEXT, sampler, _gen(5), prompt_text_tokens=[471, 258], prompt_speech_tokens=[1, 2, 3]))
    again = list(lm.generate(TEXT, sampler, _gen(5), prompt_text_tokens=[471, 258], prompt_speech_tokens=[1, 2, 3]))
    other = list(lm.generate(TEXT, sampler, _gen(6), prompt_text_tokens=[471, 258], prompt_speech_tokens=[1, 2, 3]))
    assert first == again
    assert first != other
