"""The CosyVoice2 speech-token LM (the official `Qwen2LM`, inference only, unidirectional text).

A request's LM input is [sos, embed(prompt_text ++ text), task_id, speech_embedding(prompt_speech)];
the Qwen2 decoder then predicts speech tokens one at a time through `llm_decoder`, a head over
speech_token_size + 3 ids: the speech tokens, then eos (= speech_token_size) and two bistream ids
that unidirectional inference treats as stops too. Length bounds come from the text alone (prompt
text excluded): at least min_token_text_ratio x, at most max_token_text_ratio x its token count.

The module keeps the official parameter names (`llm_embedding`, `llm.model...`, `llm_decoder`,
`speech_embedding`) so `llm.pt` loads strictly. Decoding state lives in a `StaticKVCache` set up
with `setup_cache`; `prefill` / `decode_step` work on batches of cache slots so a scheduler can run
continuous batching, and `generate` is the simple one-request loop with the official stop rules.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from tts_core.host_copy import to_device
from tts_core.llm.kv_cache import StaticKVCache
from tts_core.llm.qwen2 import ProjectionFactory, Qwen2Config, Qwen2Encoder
from tts_core.llm.sampling import RasSampler

TokenIds = torch.Tensor | Sequence[int]

SOS_ROW = 0  # rows of llm_embedding, fixed by the official model
TASK_ID_ROW = 1


class SpeechTokenLM(nn.Module):
    def __init__(self, qwen: Qwen2Config, speech_token_size: int, llm_input_size: int | None = None,
                 llm_output_size: int | None = None, min_token_text_ratio: float = 2.0,
                 max_token_text_ratio: float = 20.0) -> None:
        super().__init__()
        input_size = llm_input_size or qwen.hidden_size
        output_size = llm_output_size or qwen.hidden_size
        if input_size != qwen.hidden_size or output_size != qwen.hidden_size:
            raise ValueError(f"llm_input_size {input_size} / llm_output_size {output_size} must equal the Qwen2 "
                             f"hidden_size {qwen.hidden_size}")
        self.speech_token_size = speech_token_size
        self.eos_token = speech_token_size
        self.min_token_text_ratio = min_token_text_ratio
        self.max_token_text_ratio = max_token_text_ratio
        self.llm = Qwen2Encoder(qwen)
        self._make_speech_layers(input_size, output_size)
        self.kv_cache: StaticKVCache | None = None

    def _make_speech_layers(self, input_size: int, output_size: int) -> None:
        """The layers around Qwen2, named as in the official checkpoint (CosyVoice3 overrides this)."""
        self.llm_embedding = nn.Embedding(2, input_size)
        self.llm_decoder = nn.Linear(output_size, self.speech_token_size + 3)
        self.speech_embedding = nn.Embedding(self.speech_token_size + 3, input_size)

    def _sos_and_task_id(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (1, D) embeddings that open the input and separate text from speech."""
        return (self.llm_embedding.weight[SOS_ROW:SOS_ROW + 1],
                self.llm_embedding.weight[TASK_ID_ROW:TASK_ID_ROW + 1])

    # ---- cache -------------------------------------------------------------------------------
    def setup_cache(self, max_batch: int, max_len: int, dtype: torch.dtype | None = None) -> StaticKVCache:
        """Allocate the decoding cache on the model's device (replacing any previous one)."""
        cfg = self.llm.config
        weight = self.llm_decoder.weight
        self.kv_cache = StaticKVCache(cfg.num_hidden_layers, max_batch, cfg.num_key_value_heads, max_len,
                                      cfg.head_dim, device=weight.device, dtype=dtype or weight.dtype)
        return self.kv_cache

    def _cache(self) -> StaticKVCache:
        if self.kv_cache is None:
            raise RuntimeError("SpeechTokenLM.setup_cache(max_batch, max_len) must be called before decoding")
        return self.kv_cache

    def fuse_projections(self) -> None:
        """One q/k/v and one gate/up matmul per layer (see Qwen2Model.fuse_projections): call once
        after loading and moving the model; the state dict keeps its official keys."""
        self.llm.model.model.fuse_projections()

    def convert_projections(self, make: ProjectionFactory) -> None:
        """The decoder layers' linear projections through `make` (see Qwen2Model.convert_projections);
        the speech head `llm_decoder` keeps the model dtype: it sets the sampling distribution."""
        self.llm.model.model.convert_projections(make)

    # ---- inputs ------------------------------------------------------------------------------
    @torch.inference_mode()
    def build_prefill_input(self, text_tokens: TokenIds, prompt_text_tokens: TokenIds = (),
                            prompt_speech_tokens: TokenIds = ()) -> torch.Tensor:
        """The official lm_input for one request, (T, D): sos, text embeddings, task_id, prompt speech."""
        device = self.speech_embedding.weight.device
        text = torch.cat([_ids(prompt_text_tokens, device), _ids(text_tokens, device)])
        sos, task_id = self._sos_and_task_id()
        parts = [
            sos,
            self.llm.model.model.embed_tokens(text),
            task_id,
            self.speech_embedding(_ids(prompt_speech_tokens, device)),
        ]
        return torch.cat(parts, dim=0)

    def length_bounds(self, text_token_count: int) -> tuple[int, int]:
        """(min_len, max_len) speech tokens for a text of that many tokens (prompt text excluded)."""
        return int(text_token_count * self.min_token_text_ratio), int(text_token_count * self.max_token_text_ratio)

    # ---- batched decoding --------------------------------------------------------------------
    def _logp(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.llm_decoder(hidden).float().log_softmax(dim=-1)

    @torch.inference_mode()
    def prefill(self, slots: torch.Tensor | Sequence[int], inputs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Start one request per slot from its lm_input (T_i, D); returns logp (B, V) of each last position.

        Inputs of different lengths are right-padded; the padding writes cache positions past each
        slot's length, which stay masked and are overwritten by that slot's next steps."""
        cache = self._cache()
        slots = torch.as_tensor(slots, device=cache.lengths.device, dtype=torch.long)
        lengths = torch.tensor([x.shape[0] for x in inputs], device=slots.device)
        longest = int(lengths.max())
        embeds = torch.zeros(len(inputs), longest, inputs[0].shape[-1], device=inputs[0].device,
                             dtype=inputs[0].dtype)
        for row, x in enumerate(inputs):
            embeds[row, : x.shape[0]] = x
        positions = torch.arange(longest, device=slots.device).expand(len(inputs), longest)
        cache.reset(slots)
        hidden = self.llm(embeds.to(self.llm_decoder.weight.dtype), cache, slots, positions, longest)
        cache.advance(slots, lengths)
        last = hidden[torch.arange(len(inputs), device=slots.device), lengths - 1]
        return self._logp(last)

    @torch.inference_mode()
    def decode_step(self, slots: torch.Tensor | Sequence[int], tokens: torch.Tensor | Sequence[int],
                    attend_len: int | None = None) -> torch.Tensor:
        """Feed one speech token per slot (each at its own position); returns logp (B, V).

        `attend_len` bounds the cache columns read (default: all; keep it fixed when capturing)."""
        cache = self._cache()
        slots = torch.as_tensor(slots, device=cache.lengths.device, dtype=torch.long)
        tokens = torch.as_tensor(tokens, device=slots.device, dtype=torch.long)
        embeds = self.speech_embedding(tokens)[:, None, :]
        positions = cache.lengths[slots][:, None]
        hidden = self.llm(embeds, cache, slots, positions, attend_len or cache.max_len)
        cache.advance(slots, torch.ones_like(slots))
        return self._logp(hidden[:, 0])

    @torch.inference_mode()
    def teacher_forced_logp(self, lm_input: torch.Tensor) -> torch.Tensor:
        """logp (T, V) at every position of one causal forward over `lm_input` (T, D)."""
        return self._logp(self.teacher_forced_hidden(lm_input))

    @torch.inference_mode()
    def teacher_forced_hidden(self, lm_input: torch.Tensor) -> torch.Tensor:
        """Qwen2's last hidden state (T, D) over `lm_input` (T, D), after the final norm; uses a
        private one-slot cache so the decoding cache is untouched."""
        cfg = self.llm.config
        length = lm_input.shape[0]
        cache = StaticKVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, length, cfg.head_dim,
                              device=lm_input.device, dtype=self.llm_decoder.weight.dtype)
        slots = torch.zeros(1, dtype=torch.long, device=lm_input.device)
        positions = torch.arange(length, device=lm_input.device)[None]
        return self.llm(lm_input[None], cache, slots, positions, length)[0]

    # ---- one request -------------------------------------------------------------------------
    def generate(self, text_tokens: TokenIds, sampler: RasSampler, generator: torch.Generator,
                 prompt_text_tokens: TokenIds = (), prompt_speech_tokens: TokenIds = (),
                 slot: int = 0) -> Iterator[int]:
        """Stream speech tokens for one request in cache row `slot`, with the official rules
        (`check_request`, `next_token`, `is_stop`; CosyVoice2: stop tokens rejected before min_len,
        stop on any id >= speech_token_size), at most max_len."""
        self.check_request(text_tokens, prompt_text_tokens)
        cache = self._cache()
        min_len, max_len = self.length_bounds(_ids(text_tokens, cache.lengths.device).numel())
        lm_input = self.build_prefill_input(text_tokens, prompt_text_tokens, prompt_speech_tokens)
        needed = lm_input.shape[0] + max_len - 1
        if needed > cache.max_len:
            raise ValueError(f"request needs {needed} cache positions; the cache holds {cache.max_len}")
        logp = self.prefill([slot], [lm_input])[0]
        history: list[int] = []
        for step in range(max_len):
            if step > 0:
                logp = self.decode_step([slot], [history[-1]])[0]
            token = self.next_token(sampler, logp, history, generator, before_min_len=step < min_len)
            if self.is_stop(token):
                return
            history.append(token)
            yield token

    # ---- the official rules, per model generation ----------------------------------------------
    def check_request(self, text_tokens: TokenIds, prompt_text_tokens: TokenIds) -> None:
        """Refuse a request the official model refuses (CosyVoice2: none)."""

    def next_token(self, sampler: RasSampler, logp: torch.Tensor, history: list[int], generator: torch.Generator,
                   before_min_len: bool) -> int:
        """CosyVoice2: stop ids are redrawn before min_len (the official `sampling_ids`)."""
        return sampler.sample(logp, history, generator, allow_stop=not before_min_len)

    def is_stop(self, token: int) -> bool:
        return token >= self.speech_token_size


def _ids(tokens: TokenIds, device: torch.device) -> torch.Tensor:
    # Without a host wait: on the decode thread a prefill's ids are built while earlier prefills
    # still run on the same stream (tts_core/host_copy.py).
    return to_device(tokens, torch.long, device).reshape(-1)
