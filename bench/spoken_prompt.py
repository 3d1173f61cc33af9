"""Bench prompt texts sized to how long the serving engine speaks them, and the KV length that takes.

The instant engine speaks 60 ms a character (`chars_text`). The full-size random-weight CosyVoice model that the
GPU benches serve (bench/full_model.py) never stops on its own: its stop id is one of 6,564 near-uniform
scores, so a text segment runs to its length cap, min(20 x its text tokens (the official
max_token_text_ratio), the KV positions left after its prefill) (on CPU, 3 of 3 seeds ran a 20-token text to
its 400-token cap). min_len (2 x text tokens) only stops it stopping earlier. So `RandomModelPrompts` makes a
one-segment text of at least ceil(seconds x 25 / 20) tokens with the engine's own frontend: at 30 s, 38-39 tokens
(52-59 characters) -> 760-780 speech tokens = 30.4-31.2 s, and a KV length of the prefill (sos, the voice's
prompt text, the text, task id, the voice's prompt speech) + those tokens: 970-991 for bench_voice, past the GPU
benches' 768, so `raise_max_len` raises the served config's `max_len` to the next power of two (1024; the
attend buckets are powers of two).

Sized by characters instead (`--prompt-length chars`, the benches' way before), 30 s was 500 characters = 309
tokens: a 481-position prefill left 287 of max_len 768, so every call ended at 11.5 s. A text long enough for
min_len alone to force 30 s (375 tokens) would need max_len ~1300 and a 547-position prefill, past the largest
prefill graph (512): every first chunk would pay an eager prefill, which no product call of that length does
(a real 30-s prompt is ~5 segments of <= 80 tokens).
"""

from __future__ import annotations

import math
from pathlib import Path

MS_PER_CHAR = 60.0  # the instant engine's default: a text of N characters is N x 60 ms of its audio
TOKENS_PER_S = 25  # CosyVoice speech tokens
MAX_TOKEN_TEXT_RATIO = 20  # the official LM's cap: speech tokens per text token
PROMPT_LENGTHS = ("spoken", "chars")  # --prompt-length: as the engine speaks it, or 60 ms a character


def repeated(words: str, chars: int) -> str:
    return (words * (chars // len(words) + 1))[:chars]


def chars_text(seconds: float, words: str) -> str:
    """`words` repeated to seconds / 60 ms characters (the instant engine's length)."""
    return repeated(words, int(seconds * 1000 / MS_PER_CHAR))


class RandomModelPrompts:
    """Texts that the random-weight model in `model_dir` speaks for a given time with `voice`, counted with the
    engine's own text frontend (normaliser + the family's tokenizer)."""

    def __init__(self, model_dir: str | Path, voice: str | None = None) -> None:
        from tts_core.model_dir import ModelDir
        from tts_core.text.frontend import TextFrontend
        from tts_core.text.normalize import TextNormalizer
        from tts_core.voice_files import text_tokenizer
        from tts_core.voices import VoiceBank

        md = ModelDir.open(model_dir)
        tokenizer = text_tokenizer(md)
        self._frontend = TextFrontend(tokenizer, TextNormalizer(tokenizer))
        bank = VoiceBank.load(md.root)
        spoken = bank.get(voice or bank.names()[0])
        self._prompt_positions = 2 + len(spoken.prompt_text) + len(spoken.llm_prompt_speech_token)  # + sos, task id

    def text(self, seconds: float, words: str) -> str:
        """The shortest `words`-repeated text of one segment whose cap is >= `seconds` of speech."""
        tokens = math.ceil(seconds * TOKENS_PER_S / MAX_TOKEN_TEXT_RATIO)
        chars = 1
        while self._tokens(repeated(words, chars).strip()) < tokens:
            chars += 1
        return repeated(words, chars).strip()

    def seconds(self, text: str) -> float:
        """How long the random model speaks `text` (its segments' caps, given a KV room large enough)."""
        return sum(len(s) for s in self._frontend(text)) * MAX_TOKEN_TEXT_RATIO / TOKENS_PER_S

    def kv_positions(self, text: str) -> int:
        """KV positions the longest segment of `text` takes: its prefill and its speech tokens."""
        return max(self._prompt_positions + len(s) * (1 + MAX_TOKEN_TEXT_RATIO) for s in self._frontend(text))

    def _tokens(self, text: str) -> int:
        segments = self._frontend(text)
        if len(segments) > 1:
            raise ValueError(f"the bench text {text[:40]!r}... splits into {len(segments)} segments")
        return len(segments[0]) if segments else 0


def raise_max_len(engine: dict, positions: int) -> int | None:
    """Raise `engine.cosyvoice2.max_len` (default 2048) to the next power of two >= `positions` where it holds
    fewer; the new value, or None when it was large enough."""
    settings = engine.setdefault("cosyvoice2", {})
    if int(settings.get("max_len", 2048)) >= positions:
        return None
    settings["max_len"] = 1 << (positions - 1).bit_length()
    return settings["max_len"]


class BenchPrompts:
    """The texts a bench serves, sized for the engine of `config` (a gateway config mapping): `spoken`, as long as
    that engine speaks them (the full-size random model for cosyvoice2, else 60 ms a character); `chars`, 60 ms a
    character for every engine. `fit` then raises the config's max_len to what the texts handed out need."""

    def __init__(self, config: dict, prompt_length: str = "spoken") -> None:
        engine = config.get("engine", {})
        settings = engine.get("cosyvoice2") or {}
        self._model = None
        if prompt_length == "spoken" and engine.get("name") == "cosyvoice2":
            self._model = RandomModelPrompts(settings["model_dir"], settings.get("default_voice"))
        self._kv_positions = 0
        self.spoken_s: dict[str, float] = {}  # "<asked seconds> s <words>" -> how long the model speaks the text

    def text(self, seconds: float, words: str) -> str:
        if self._model is None:
            return chars_text(seconds, words)
        text = self._model.text(seconds, words)
        self._kv_positions = max(self._kv_positions, self._model.kv_positions(text))
        self.spoken_s[f"{seconds:g} s {words.strip()}"] = self._model.seconds(text)
        return text

    def fit(self, config: dict) -> dict:
        """What was sized (printed by the benches, kept in their results): each asked length's spoken seconds, and
        the max_len raised for them (None: the config's was enough)."""
        raised = raise_max_len(config["engine"], self._kv_positions) if self._model is not None else None
        return {"prompt_length": "spoken, random model" if self._model is not None else "chars, 60 ms each",
                "spoken_s": dict(self.spoken_s), "max_len_raised_to": raised}
