"""CosyVoice3's flow (the official `CausalMaskedDiffWithDiT`): speech tokens + prompt -> mel frames.

Compared with CosyVoice2's `FlowModel` there is no conformer encoder and no `encoder_proj`: the token
embeddings go through the pre-lookahead convolution (the same `PreLookahead` block, 80 channels in
and out) and are repeated `token_mel_ratio` times along time; that is mu. The estimator is the DiT
(`tts_core.flow.dit`), driven by the same `FlowSampler` (fixed noise, cosine schedule, CFG).

`inference` re-renders prompt + all tokens so far (no cache of any kind, as the official code does);
in streaming mode the DiT's attention is chunk-causal, so earlier frames come out the same, which is
what lets the runtime render only new frames (`dit_pool.DiTContextPool`). A non-final call uses its
last `pre_lookahead_len` tokens as lookahead only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
from torch import nn

from tts_core.checkpoint import load_strict, read_state_dict
from tts_core.flow.config import OFFICIAL_N_TIMESTEPS
from tts_core.flow.dit import DiTConfig, DiTEstimator
from tts_core.flow.model import FlowConditioning, check_official_call, speaker_condition
from tts_core.flow.sampler import FlowSampler
from tts_core.flow.token_encoder import PreLookahead
from tts_core.model_family import detect_family

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class DiTFlowConfig:
    vocab_size: int
    input_size: int
    output_size: int
    spk_embed_dim: int
    token_mel_ratio: int
    pre_lookahead_len: int
    lookahead_channels: int
    n_timesteps: int
    t_scheduler: str
    inference_cfg_rate: float
    estimator: DiTConfig


def _get(section: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(section, Mapping) or key not in section:
        raise ValueError(f"cosyvoice3.yaml: missing `{where}.{key}`")
    return section[key]


def dit_flow_config_from(yaml_cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> DiTFlowConfig:
    """Sizes from the yaml's `flow:` section; the lookahead width from the weights."""
    flow = _get(yaml_cfg, "flow", "")
    dec = _get(flow, "decoder", "flow")
    est = _get(dec, "estimator", "flow.decoder")
    cfm = _get(_get(dec, "cfm_params", "flow.decoder"), "content", "flow.decoder.cfm_params")
    estimator = DiTConfig(**{k: int(_get(est, k, "flow.decoder.estimator")) for k in (
        "dim", "depth", "heads", "dim_head", "ff_mult", "mel_dim", "mu_dim", "spk_dim", "out_channels",
        "static_chunk_size")}, num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)))
    lookahead = state.get("pre_lookahead_layer.conv1.weight")
    if lookahead is None:
        raise ValueError("flow.pt: no pre_lookahead_layer.conv1.weight (not a CosyVoice3 flow checkpoint)")
    cfg = DiTFlowConfig(
        vocab_size=int(_get(flow, "vocab_size", "flow")),
        input_size=int(_get(flow, "input_size", "flow")),
        output_size=int(_get(flow, "output_size", "flow")),
        spk_embed_dim=int(_get(flow, "spk_embed_dim", "flow")),
        token_mel_ratio=int(_get(flow, "token_mel_ratio", "flow")),
        pre_lookahead_len=int(_get(flow, "pre_lookahead_len", "flow")),
        lookahead_channels=int(lookahead.shape[0]),
        n_timesteps=OFFICIAL_N_TIMESTEPS,
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(_get(cfm, "inference_cfg_rate", "flow.decoder.cfm_params")),
        estimator=estimator,
    )
    if int(lookahead.shape[2]) - 1 != cfg.pre_lookahead_len:
        raise ValueError(f"flow.pt: pre-lookahead kernel {int(lookahead.shape[2])} disagrees with "
                         f"pre_lookahead_len={cfg.pre_lookahead_len}")
    if cfg.t_scheduler not in ("cosine", "linear"):
        raise ValueError(f"cosyvoice3.yaml: t_scheduler={cfg.t_scheduler!r} is not supported")
    return cfg


class DiTFlowModel(nn.Module):
    def __init__(self, cfg: DiTFlowConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.input_embedding = nn.Embedding(cfg.vocab_size, cfg.input_size)
        self.spk_embed_affine_layer = nn.Linear(cfg.spk_embed_dim, cfg.output_size)
        self.pre_lookahead_layer = PreLookahead(cfg.input_size, cfg.lookahead_channels, cfg.pre_lookahead_len)
        self.decoder = FlowSampler(DiTEstimator(cfg.estimator), cfg.output_size, cfg.n_timesteps,
                                   cfg.t_scheduler, cfg.inference_cfg_rate)

    def speaker(self, embedding: torch.Tensor) -> torch.Tensor:
        return speaker_condition(self.spk_embed_affine_layer, embedding)

    def token_features(self, tokens: torch.Tensor, finalize: bool) -> torch.Tensor:
        """All tokens (prompt included) -> (1, rendered tokens, 80) before the x token_mel_ratio repeat."""
        emb = self.input_embedding(torch.clamp(tokens, min=0).long())
        if finalize:
            return self.pre_lookahead_layer(emb)
        k = self.cfg.pre_lookahead_len
        return self.pre_lookahead_layer(emb[:, :-k], context=emb[:, -k:])

    def condition(self, token: torch.Tensor, prompt_token: torch.Tensor, prompt_feat: torch.Tensor,
                  embedding: torch.Tensor, finalize: bool) -> FlowConditioning:
        if token.size(0) != 1:
            raise ValueError("flow inference takes batch 1")
        h = self.token_features(torch.cat([prompt_token, token], dim=1), finalize)
        mu = h.repeat_interleave(self.cfg.token_mel_ratio, dim=1).transpose(1, 2).contiguous()
        prompt_frames = prompt_feat.size(1)
        cond = torch.zeros_like(mu)
        cond[:, :, :prompt_frames] = prompt_feat.transpose(1, 2).to(mu.dtype)
        mask = torch.ones(1, 1, mu.size(2), device=mu.device, dtype=mu.dtype)
        return FlowConditioning(mu, cond, mask, self.speaker(embedding), prompt_frames)

    @torch.inference_mode()
    def inference(self, token: torch.Tensor, token_len: torch.Tensor, prompt_token: torch.Tensor,
                  prompt_token_len: torch.Tensor, prompt_feat: torch.Tensor, prompt_feat_len: torch.Tensor,
                  embedding: torch.Tensor, streaming: bool, finalize: bool) -> tuple[torch.Tensor, None]:
        """Official signature. Returns (mel (1, 80, new frames) float32, None); batch 1, the lengths
        must equal the tensors' sizes."""
        check_official_call(token, token_len, prompt_token, prompt_token_len, prompt_feat, prompt_feat_len, finalize,
                            self.cfg.pre_lookahead_len)
        c = self.condition(token, prompt_token, prompt_feat, embedding, finalize)
        mel = self.decoder(c.mu, c.mask, c.spks, c.cond, streaming)
        return mel[:, :, c.prompt_frames:], None


def load_dit_flow(model_dir: str | Path, device: torch.device | str = "cpu",
                  dtype: torch.dtype = torch.float32) -> DiTFlowModel:
    """Build from `<model_dir>/cosyvoice3.yaml` and load `<model_dir>/flow.pt` strictly."""
    model_dir = Path(model_dir)
    found = detect_family(model_dir, expected=3)
    state = read_state_dict(model_dir / "flow.pt")
    model = DiTFlowModel(dit_flow_config_from(found.raw_config, state))
    load_strict(model, state, str(model_dir / "flow.pt"))
    model.to(device=device, dtype=dtype).eval()
    log.info("flow_loaded", model_dir=str(model_dir), device=str(device), dtype=str(dtype), estimator="dit",
             dim=model.cfg.estimator.dim, depth=model.cfg.estimator.depth)
    return model
