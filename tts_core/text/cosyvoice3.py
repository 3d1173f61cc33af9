"""What CosyVoice3's text frontend adds to CosyVoice2's: special tokens, the system prefix, instructs.

- 261 more special tokens after CosyVoice2's 19: `<|endofsystem|>`, then the phoneme "hot-fix"
  tokens (ARPAbet with stress digits for English, pinyin initials and toned finals for Chinese) a
  text may carry, e.g. `[j][ǐ]`, to force a pronunciation. Their ORDER is part of the model: new
  special tokens take consecutive ids, and the LLM's text embedding rows are indexed by those ids.
- Every request carries `<|endofprompt|>` in prompt_text ++ text. Zero-shot prompt texts start with
  the system prefix; an instruct (speed, volume, emotion, dialect) is one of the texts the model was
  trained with (`cosyvoice/utils/common.py`), used as prompt_text, so it conditions the speech and is
  never spoken.

Data only; `cosyvoice3_tokenizer` builds the tokenizer from a model directory's Qwen2 files.
"""

from __future__ import annotations

from pathlib import Path

from tts_core.text.tokenizer import EXTRA_SPECIAL_TOKENS, TextTokenizer

ENDOFPROMPT = "<|endofprompt|>"
ENDOFSYSTEM = "<|endofsystem|>"
SYSTEM_PREFIX = "You are a helpful assistant." + ENDOFPROMPT

_ARPABET = """
    AA AA0 AA1 AA2 AE AE0 AE1 AE2 AH AH0 AH1 AH2 AO AO0 AO1 AO2 AW AW0 AW1 AW2 AY AY0 AY1 AY2 B CH D DH EH
    EH0 EH1 EH2 ER ER0 ER1 ER2 EY EY0 EY1 EY2 F G HH IH IH0 IH1 IH2 IY IY0 IY1 IY2 JH K L M N NG OW OW0 OW1
    OW2 OY OY0 OY1 OY2 P R S SH T TH UH UH0 UH1 UH2 UW UW0 UW1 UW2 V W Y Z ZH
""".split()

_PINYIN = """
    a ai an ang ao b c ch d e ei en eng f g h i ian in ing iu ià iàn iàng iào iá ián iáng iáo iè ié iòng
    ióng iù iú iā iān iāng iāo iē iě iōng iū iǎ iǎn iǎng iǎo iǒng iǔ j k l m n o ong ou p q r s sh t u uang
    ue un uo uà uài uàn uàng uá uái uán uáng uè ué uì uí uò uó uā uāi uān uāng uē uě uī uō uǎ uǎi uǎn uǎng
    uǐ uǒ vè w x y z zh à ài àn àng ào á ái án áng áo è èi èn èng èr é éi én éng ér ì ìn ìng í ín íng ò òng
    òu ó óng óu ù ùn ú ún ā āi ān āng āo ē ēi ēn ēng ě ěi ěn ěng ěr ī īn īng ō ōng ōu ū ūn ǎ ǎi ǎn ǎng ǎo ǐ
    ǐn ǐng ǒ ǒng ǒu ǔ ǔn ǘ ǚ ǜ
""".split()

PHONEME_TOKENS: tuple[str, ...] = tuple(f"[{p}]" for p in (*_ARPABET, *_PINYIN))

# Order matters (module docstring): CosyVoice2's tokens keep their ids, the new ones follow.
COSYVOICE3_SPECIAL_TOKENS: tuple[str, ...] = (*EXTRA_SPECIAL_TOKENS, ENDOFSYSTEM, *PHONEME_TOKENS)

# The instruct texts CosyVoice3 was trained with, in the authors' order.
INSTRUCT_TEXTS: tuple[str, ...] = (
    "You are a helpful assistant. 请用广东话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用东北话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用甘肃话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用贵州话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用河南话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用湖北话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用湖南话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用江西话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用闽南话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用宁夏话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用山西话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用陕西话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用山东话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用上海话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用四川话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用天津话表达。<|endofprompt|>",
    "You are a helpful assistant. 请用云南话表达。<|endofprompt|>",
    "You are a helpful assistant. Please say a sentence as loudly as possible.<|endofprompt|>",
    "You are a helpful assistant. Please say a sentence in a very soft voice.<|endofprompt|>",
    "You are a helpful assistant. 请用尽可能慢地语速说一句话。<|endofprompt|>",
    "You are a helpful assistant. 请用尽可能快地语速说一句话。<|endofprompt|>",
    "You are a helpful assistant. 请非常开心地说一句话。<|endofprompt|>",
    "You are a helpful assistant. 请非常伤心地说一句话。<|endofprompt|>",
    "You are a helpful assistant. 请非常生气地说一句话。<|endofprompt|>",
    "You are a helpful assistant. 我想体验一下小猪佩奇风格，可以吗？<|endofprompt|>",
    "You are a helpful assistant. 你可以尝试用机器人的方式解答吗？<|endofprompt|>",
)


def cosyvoice3_tokenizer(tokenizer_dir: str | Path) -> TextTokenizer:
    return TextTokenizer(tokenizer_dir, extra_special_tokens=COSYVOICE3_SPECIAL_TOKENS)


def zero_shot_prompt_text(transcript: str) -> str:
    """The prompt text of a zero-shot voice: the system prefix, then what the prompt audio says."""
    return transcript if ENDOFPROMPT in transcript else SYSTEM_PREFIX + transcript


# What an operator or caller names (route `dialect:`/`instruct:`, X-TTS-Dialect/-Instruct, the API's
# fields) -> the instruct text above. The dialects are the first 17 of the authors' list, in order.
DIALECTS: dict[str, str] = dict(zip(
    ("cantonese", "dongbei", "gansu", "guizhou", "henan", "hubei", "hunan", "jiangxi", "minnan", "ningxia",
     "shanxi", "shaanxi", "shandong", "shanghai", "sichuan", "tianjin", "yunnan"), INSTRUCT_TEXTS[:17]))
INSTRUCTS: dict[str, str] = dict(zip(
    ("loud", "soft", "slow", "fast", "happy", "sad", "angry", "peppa_pig", "robot"), INSTRUCT_TEXTS[17:]))


def instruct_text(instruct: str | None, dialect: str | None) -> str | None:
    """The instruct text for a request's `instruct` or `dialect` name (None: neither); ValueError
    names the field. The model was trained with one instruct per request, so not both."""
    if instruct is not None and dialect is not None:
        raise ValueError("instruct and dialect: give one (CosyVoice3 takes one instruct per request)")
    for field, value, table in (("instruct", instruct, INSTRUCTS), ("dialect", dialect, DIALECTS)):
        if value is not None:
            if value not in table:
                raise ValueError(f"{field}: {value!r} is not one of {', '.join(table)}")
            return table[value]
    return None
