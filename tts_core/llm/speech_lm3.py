"""The CosyVoice3 speech-token LM (the official `CosyVoice3LM`, inference only).

Same Qwen2 decoder and input layout as CosyVoice2's `SpeechTokenLM` (sos, embed(prompt_text ++
text), task_id, speech_embedding(prompt_speech)); what differs:

- no `llm_embedding` table: sos, eos, task_id and fill are rows speech_token_size + 0..3 of
  `speech_embedding`, which has speech_token_size + 200 rows; `llm_decoder` has as many outputs and
  no bias. Every id >= speech_token_size is a stop id (the id is never emitted).
- before min_len the official PyTorch loop masks only id speech_token_size (sos) and samples once:
  eos or any other stop id may still end decoding early. We reproduce that (the golden set records
  it); suppressing all stop ids would change which requests end when.
- every request carries `<|endofprompt|>` in prompt_text ++ text (the official code asserts it);
  its id comes from the tokenizer, not the number the official code hard-codes.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from tts_core.llm.qwen2 import Qwen2Config
from tts_core.llm.speech_lm import SpeechTokenLM, TokenIds, _ids

SOS_OFFSET, EOS_OFFSET, TASK_ID_OFFSET, FILL_OFFSET = 0, 1, 2, 3
STOP_ID_COUNT = 200  # rows after the speech tokens, all of them stop ids


class TokenDraw(Protocol):
    """One draw of the next token (RasSampler.ras has this shape)."""

    def ras(self, logp: torch.Tensor, history: list[int], generator: torch.Generator) -> int: ...


class MissingEndOfPrompt(ValueError):
    pass


class CosyVoice3LM(SpeechTokenLM):
    def __init__(self, qwen: Qwen2Config, speech_token_size: int, endofprompt_id: int,
                 llm_input_size: int | None = None, llm_output_size: int | None = None,
                 min_token_text_ratio: float = 2.0, max_token_text_ratio: float = 20.0) -> None:
        super().__init__(qwen, speech_token_size, llm_input_size, llm_output_size, min_token_text_ratio,
                         max_token_text_ratio)
        self.endofprompt_id = endofprompt_id
        self.sos_token = speech_token_size + SOS_OFFSET
        self.eos_token = speech_token_size + EOS_OFFSET
        self.task_id_token = speech_token_size + TASK_ID_OFFSET
        self.fill_token = speech_token_size + FILL_OFFSET

    def _make_speech_layers(self, input_size: int, output_size: int) -> None:
        rows = self.speech_token_size + STOP_ID_COUNT
        self.llm_decoder = nn.Linear(output_size, rows, bias=False)
        self.speech_embedding = nn.Embedding(rows, input_size)

    def _sos_and_task_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        sos = self.speech_token_size + SOS_OFFSET
        task = self.speech_token_size + TASK_ID_OFFSET
        weight = self.speech_embedding.weight
        return weight[sos:sos + 1], weight[task:task + 1]

    def check_request(self, text_tokens: TokenIds, prompt_text_tokens: TokenIds) -> None:
        device = self.speech_embedding.weight.device
        ids = torch.cat([_ids(prompt_text_tokens, device), _ids(text_tokens, device)])
        if not bool((ids == self.endofprompt_id).any()):
            raise MissingEndOfPrompt("CosyVoice3 needs <|endofprompt|> in prompt_text ++ text (a zero-shot "
                                     "prompt text starts with the system prefix; an instruct ends with it)")

    def mask_before_min_len(self, logp: torch.Tensor) -> torch.Tensor:
        """The official rule before min_len: only id speech_token_size (sos) is made impossible."""
        masked = logp.clone()
        masked[..., self.speech_token_size] = float("-inf")
        return masked

    def next_token(self, sampler: TokenDraw, logp: torch.Tensor, history: list[int],  # type: ignore[override]
                   generator: torch.Generator, before_min_len: bool) -> int:
        """One draw; before min_len from the sos-masked scores, so other stop ids may still end early."""
        return sampler.ras(self.mask_before_min_len(logp) if before_min_len else logp, history, generator)
