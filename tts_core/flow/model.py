"""FlowModel: speech tokens + speaker prompt -> mel frames (CosyVoice2's CausalMaskedDiffWithXvec).

One call renders the mel for `prompt_token ++ token` with the prompt mel as a fixed condition, and
returns only the frames after the prompt. In streaming mode (`streaming=True`) every attention in
the encoder and the estimator is chunk-causal; a non-final call (`finalize=False`) treats its last
`pre_lookahead_len` tokens as lookahead only, so it renders `token_mel_ratio` frames for each of the
other tokens. The official streaming caller re-runs the whole prefix on every call and keeps the
new frames; `tts_core.flow.incremental` avoids that re-run.

Thread-safety: inference only reads the module; one model may serve several threads if each owns
its tensors (the noise buffer is read-only).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import structlog
import torch
from torch import nn
from torch.nn import functional as F

from tts_core.checkpoint import load_strict, read_state_dict
from tts_core.flow.config import FlowConfig, flow_config_from
from tts_core.flow.estimator import FlowEstimator
from tts_core.flow.residual_scale import residual_scale_for, scale_residual_stream
from tts_core.flow.sampler import FlowSampler
from tts_core.flow.token_encoder import TokenEncoder
from tts_core.model_family import detect_family

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class FlowConditioning:
    """Everything the sampler needs for one call (batch 1): (1, 80, T) tensors and the speaker."""

    mu: torch.Tensor
    cond: torch.Tensor
    mask: torch.Tensor
    spks: torch.Tensor
    prompt_frames: int


def check_official_call(token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                        prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                        finalize: bool, pre_lookahead_len: int) -> None:
    """The official flow signature at batch 1: each length must equal its tensor's size, and a
    non-final call must have tokens beyond its lookahead."""
    for name, tensor, length in (("token", token, token_len), ("prompt_token", prompt_token, prompt_token_len),
                                 ("prompt_feat", prompt_feat, prompt_feat_len)):
        if int(length.reshape(-1)[0]) != tensor.size(1):
            raise ValueError(f"flow: {name}_len={int(length.reshape(-1)[0])} but {name} has {tensor.size(1)}")
    if not finalize and token.size(1) + prompt_token.size(1) <= pre_lookahead_len:
        raise ValueError("flow: a non-final call needs more tokens than the lookahead")


def speaker_condition(affine: nn.Linear, embedding: torch.Tensor) -> torch.Tensor:
    """(1, 192) x-vector -> (1, 80) conditioning (L2-normalised first, as trained)."""
    return affine(F.normalize(embedding, dim=1))


class FlowModel(nn.Module):
    def __init__(self, cfg: FlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.encoder = TokenEncoder(cfg.encoder)
        self.encoder_proj = nn.Linear(cfg.encoder.output_size, cfg.output_size)
        self.decoder = FlowSampler(FlowEstimator(cfg.estimator), cfg.output_size, cfg.n_timesteps,
                                   cfg.t_scheduler, cfg.inference_cfg_rate)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        return speaker_condition(self.spk_embed_affine_layer, embedding)

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        # Batch 1 has no padding, so the official padding mask is all ones and is not applied.
        return self.input_embedding(torch.clamp(tokens, min=0).long())

    def encode(self, tokens: torch.Tensor, streaming: bool, finalize: bool) -> torch.Tensor:
        """All tokens (prompt included) -> encoder output (1, frames, D) before `encoder_proj`."""
        emb = self.embed_tokens(tokens)
        if finalize:
            return self.encoder(emb, streaming)
        k = self.cfg.pre_lookahead_len
        return self.encoder(emb[:, :-k], streaming, context_emb=emb[:, -k:])

    def condition(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool, finalize: bool) -> FlowConditioning:
        if token.size(0) != 1:
            raise ValueError("flow inference takes batch 1")
        spks = self.speaker(embedding)
        h = self.encode(torch.cat([prompt_token, token], dim=1), streaming, finalize)
        prompt_frames = prompt_feat.size(1)
        mu = self.encoder_proj(h).transpose(1, 2).contiguous()
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = torch.ones(1, 1, mu.size(2), device=mu.device, dtype=mu.dtype)
        return FlowConditioning(mu, cond, mask, spks, prompt_frames)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                  prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool, finalize: bool) -> tuple[torch.Tensor, None]:
        """Official signature. Returns (mel (1, 80, new_frames) float32, None). Batch 1: the lengths
        must equal the tensors' sizes (they are checked, not used for padding)."""
        check_official_call(token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, finalize,
                            self.cfg.pre_lookahead_len)
        c = self.condition(token, prompt_token, prompt_feat, embedding, streaming, finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, streaming)
        return mel[:, :, c.prompt_frames:], None


def load_flow(model_dir: str | Path, device: torch.device | str = "cpu",
              dtype: torch.dtype = torch.float32) -> FlowModel:
    """Build from `<model_dir>/cosyvoice2.yaml` and load `<model_dir>/flow.pt` strictly."""
    model_dir = Path(model_dir)
    found = detect_family(model_dir, expected=2)
    state = read_state_dict(model_dir / "flow.pt")
    cfg = flow_config_from(found.raw_config, state)
    model = FlowModel(cfg)
    load_strict(model, state, str(model_dir / "flow.pt"))
    # float16: the estimator's residual stream is carried scaled down (folded here, in float32).
    scale_residual_stream(model.decoder.estimator, residual_scale_for(dtype))
    model.to(device=device, dtype=dtype).eval()
    log.info("flow_loaded", model_dir=str(model_dir), device=str(device), dtype=str(dtype),
             encoder_width=cfg.encoder.output_size, estimator_channels=cfg.estimator.channels)
    return model
