"""The CosyVoice text tokenizer: Qwen2's byte-level BPE plus CosyVoice's extra special tokens.

Built from the model's `CosyVoice-BlankEN/` files (`vocab.json`, `merges.txt`,
`tokenizer_config.json`) with the `tokenizers` package, so transformers is not needed. It mirrors
what the official wrapper gets from `AutoTokenizer` (a Qwen2 fast tokenizer converted from those
files) followed by `add_special_tokens`:

- NFC normalisation, then Qwen2's pre-tokenizer split (digits one at a time, letters with at most one
  leading non-letter, punctuation runs, whitespace rules), then GPT-2 byte-to-unicode and BPE.
- Special tokens are matched verbatim in the input before any of that (the official frontend encodes
  with `allowed_special='all'`), so `[breath]` or `<strong>` in a text are single ids.
- Ids of the extra special tokens depend on their order: a token already known keeps its id, a new
  one takes the next free id. `EXTRA_SPECIAL_TOKENS` therefore keeps the official order (CosyVoice2's
  list; CosyVoice3 appends to it, see `tts_core/text/cosyvoice3.py`).

Must never change the order or spelling of the special tokens: the LLM's text embedding rows are
indexed by these ids.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

# Qwen2's pre-tokenizer pattern (as in its tokenizer.json / Qwen2Tokenizer): unlike GPT-2 it splits
# digits one by one and lets one non-letter lead a word.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

EOS_TOKEN = "<|endoftext|>"

# Order matters: new tokens take consecutive ids in this order (see module docstring).
EXTRA_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|im_start|>", "<|im_end|>", "<|endofprompt|>",
    "[breath]", "<strong>", "</strong>", "[noise]",
    "[laughter]", "[cough]", "[clucking]", "[accent]",
    "[quick_breath]",
    "<laughter>", "</laughter>",
    "[hissing]", "[sigh]", "[vocalized-noise]",
    "[lipsmack]", "[mn]",
)


class TextTokenizer:
    """Encode text to the ids the speech LM was trained on, and decode them back."""

    def __init__(self, tokenizer_dir: str | Path,
                 extra_special_tokens: tuple[str, ...] = EXTRA_SPECIAL_TOKENS) -> None:
        tokenizer_dir = Path(tokenizer_dir)
        for name in ("vocab.json", "merges.txt"):
            if not (tokenizer_dir / name).is_file():
                raise FileNotFoundError(f"tokenizer file missing: {tokenizer_dir / name}")
        vocab, merges = models.BPE.read_file(str(tokenizer_dir / "vocab.json"), str(tokenizer_dir / "merges.txt"))
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        tok.decoder = decoders.ByteLevel()

        # Tokens the model dir already declares keep their ids (Qwen2's own <|endoftext|>,
        # <|im_start|>, ... at the end of its vocabulary); add them in id order so ids line up.
        for token_id, declared in sorted(_declared_added_tokens(tokenizer_dir).items()):
            content = declared.content
            if declared.special:
                tok.add_special_tokens([declared])
            else:
                tok.add_tokens([declared])
            if tok.token_to_id(content) != token_id:
                raise ValueError(
                    f"{tokenizer_dir / 'tokenizer_config.json'}: added token {content!r} declared at id "
                    f"{token_id} but the vocabulary places it at {tok.token_to_id(content)}"
                )
        tok.add_special_tokens([_special(t) for t in (EOS_TOKEN, *extra_special_tokens)])
        self._tok = tok
        self.special_tokens: tuple[str, ...] = (EOS_TOKEN, *extra_special_tokens)
        self.eos_id: int = tok.token_to_id(EOS_TOKEN)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Ids of `text`; special tokens written in the text become their single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def _special(content: str) -> AddedToken:
    return AddedToken(content, single_word=False, lstrip=False, rstrip=False, normalized=False, special=True)


def _declared_added_tokens(tokenizer_dir: Path) -> dict[int, AddedToken]:
    config_path = tokenizer_dir / "tokenizer_config.json"
    if not config_path.is_file():
        return {}
    config = json.loads(config_path.read_text(encoding="utf-8"))
    return {
        int(k): AddedToken(
            v["content"], single_word=v.get("single_word", False), lstrip=v.get("lstrip", False),
            rstrip=v.get("rstrip", False), normalized=v.get("normalized", False), special=v.get("special", True),
        )
        for k, v in config.get("added_tokens_decoder", {}).items()
    }
