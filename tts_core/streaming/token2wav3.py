"""One CosyVoice3 request's token -> waveform streaming, as the official `CosyVoice3Model.token2wav`.

Per chunk (a `ChunkTask` from the shared `ChunkPlanner`): the DiT flow re-renders prompt + all tokens
so far -- chunk-masked for a non-final chunk, FULL attention for the final one (the official loop
makes its last call without `stream`) -- and the frames from 2 x token_offset on are appended to
the request's mel. HiFT is then re-run over ALL mel so far (finalize only on the last chunk) and the
samples past those already emitted are the chunk's audio. State is just (mel so far, samples
emitted): no mel cache overlap, no source cache, no cross-fade (unlike CosyVoice2): the causal HiFT
returns a prefix of what a longer call returns, so chunks join without a seam.

This is the reference path (cost grows with the utterance: every chunk re-renders everything); a
faster one must match it. `chunk_masked_final` renders the final chunk chunk-masked instead (the
runtime's default, docs/PERF_NOTES.md "CosyVoice3's final chunk"): the reference for that choice.
Not thread-safe: one instance per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tts_core.flow.dit_flow import DiTFlowModel
from tts_core.hift.causal import CausalHiftGenerator
from tts_core.streaming.chunk_schedule import ChunkTask


class Token2Wav3Stream:
    def __init__(self, flow: DiTFlowModel, hift: CausalHiftGenerator, prompt_token: torch.Tensor,
                 prompt_feat: torch.Tensor, embedding: torch.Tensor, chunk_masked_final: bool = False) -> None:
        """prompt_token (1, N) int; prompt_feat (1, 2N, 80); embedding (1, 192): the speaker's flow prompt."""
        self._flow, self._hift = flow, hift
        self._chunk_masked_final = chunk_masked_final
        self._prompt_token, self._prompt_feat, self._embedding = prompt_token, prompt_feat, embedding
        self.mel = torch.zeros(1, flow.cfg.output_size, 0, dtype=prompt_feat.dtype)
        self.speech_offset = 0

    @torch.inference_mode()
    def render(self, tokens: Sequence[int] | torch.Tensor, task: ChunkTask) -> torch.Tensor:
        """The chunk's new 24 kHz samples (1, n) given the request's tokens so far."""
        new = chunk_mel(self._flow, tokens, task, self._prompt_token, self._prompt_feat, self._embedding,
                        streaming=self._chunk_masked_final or not task.finalize)
        self.mel = torch.cat([self.mel, new], dim=2)
        wav, _ = self._hift.inference(self.mel, finalize=task.finalize)
        chunk = wav[:, self.speech_offset:]
        self.speech_offset += chunk.size(1)
        return chunk


@torch.inference_mode()
def chunk_mel(flow: DiTFlowModel, tokens: Sequence[int] | torch.Tensor, task: ChunkTask, prompt_token: torch.Tensor,
              prompt_feat: torch.Tensor, embedding: torch.Tensor, streaming: bool | None = None) -> torch.Tensor:
    """The official flow call of one chunk: prompt + tokens [0, token_end) re-rendered, chunk-masked
    unless final (then full attention; `streaming` says otherwise); returns its new frames (1, 80, n)
    from 2 x token_offset on."""
    streaming = not task.finalize if streaming is None else streaming
    token = torch.as_tensor(tokens, dtype=torch.long, device=prompt_token.device).reshape(1, -1)[:, :task.token_end]
    if token.size(1) < task.token_end:
        raise ValueError(f"chunk {task.index} needs {task.token_end} tokens, {token.size(1)} exist")
    pt, pf = prompt_token, prompt_feat
    mel, _ = flow.inference(token, torch.tensor([token.size(1)]), pt, torch.tensor([pt.size(1)]), pf,
                            torch.tensor([pf.size(1)]), embedding, streaming=streaming, finalize=task.finalize)
    return mel[:, :, flow.cfg.token_mel_ratio * task.token_offset:]
