"""RuntimeFamily: the little that differs between serving CosyVoice2 and CosyVoice3 on one runtime.

The scheduler, LM runner, render lanes and jobs are the same for both generations: the speech LM
is the same Qwen2 decoder (CosyVoice3's only adds stop ids, which are ids >= speech_token_size for
both), its steps are batched the same way. What a family supplies is:
- its model parts, built from the directory (`load`): LM, flow, vocoder, and the text tokenizer
  (CosyVoice3's carries 261 more special tokens);
- the chunk renderer of its flow + vocoder (`renderer`): CosyVoice2's pooled flow with cached
  vocoder (runtime/chunk_render.py), CosyVoice3's DiT re-render with the causal HiFT
  (runtime/dit_render.py); both take the same settings and serve the render lanes alike;
- the filter between the LM's tokens and the flow's (`token_filter`: CosyVoice3 drops silent runs
  beyond 5 tokens; CosyVoice2 none);
- whether it takes instructs (`instructs`).

The family is read from the model directory (tts_core/model_family.py), never configured.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tts_core.llm.silence_filter import SilentRunFilter
from tts_core.model_dir import ModelDir
from tts_core.text.tokenizer import TextTokenizer


@dataclass(frozen=True)
class ModelParts:
    lm: Any  # SpeechTokenLM (CosyVoice3LM for family 3)
    flow: Any  # FlowModel | DiTFlowModel
    hift: Any  # HiftGenerator | CausalHiftGenerator
    tokenizer: TextTokenizer


@dataclass(frozen=True)
class RuntimeFamily:
    version: int
    load: Callable[[ModelDir, torch.device, torch.dtype], ModelParts]
    renderer: Callable[..., Any]  # (flow, hift, FlowPoolSettings) -> ChunkRenderer | DiTChunkRenderer
    token_filter: Callable[[], SilentRunFilter | None]
    instructs: bool


def _load2(md: ModelDir, device: torch.device, dtype: torch.dtype) -> ModelParts:
    from tts_core.flow import load_flow
    from tts_core.hift import load_hift
    from tts_core.model_dir import load_speech_lm

    # HiFT stays float32: its ISTFT and source phases lose audible precision in 16-bit, and it is a
    # small share of the work (both families).
    return ModelParts(load_speech_lm(md, device, dtype), load_flow(md.root, device, dtype),
                      load_hift(md.root, device, torch.float32, fold=True), TextTokenizer(md.qwen_dir))


def _load3(md: ModelDir, device: torch.device, dtype: torch.dtype) -> ModelParts:
    from tts_core.flow.dit_flow import load_dit_flow
    from tts_core.hift.causal import load_causal_hift
    from tts_core.model_dir import load_speech_lm3
    from tts_core.text.cosyvoice3 import cosyvoice3_tokenizer

    return ModelParts(load_speech_lm3(md, device, dtype), load_dit_flow(md.root, device, dtype),
                      load_causal_hift(md.root, device, torch.float32, fold=True), cosyvoice3_tokenizer(md.qwen_dir))


def _renderer2(flow, hift, settings):
    from tts_core.runtime.chunk_render import ChunkRenderer

    return ChunkRenderer(flow, hift, settings)


def _renderer3(flow, hift, settings):
    from tts_core.runtime.dit_render import DiTChunkRenderer

    return DiTChunkRenderer(flow, hift, settings)


COSYVOICE2 = RuntimeFamily(2, _load2, _renderer2, lambda: None, instructs=False)
COSYVOICE3 = RuntimeFamily(3, _load3, _renderer3, SilentRunFilter, instructs=True)
FAMILIES = {2: COSYVOICE2, 3: COSYVOICE3}


def runtime_family(model_dir: ModelDir | str | Path) -> RuntimeFamily:
    md = model_dir if isinstance(model_dir, ModelDir) else ModelDir.open(model_dir)
    return FAMILIES[md.family.version]
