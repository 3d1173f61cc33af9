"""The flow model's hyper-parameters, read from the official yaml and checked against the weights.

Every size comes from one of two places: the `flow:` section of `cosyvoice2.yaml`, or the shapes in
`flow.pt` where the official code hard-codes a constant that a re-sized checkpoint does not follow
(the encoder's pre-lookahead and upsample layers are built at a fixed 512 channels upstream, the
number of post-upsample conformer blocks is fixed at 4). Nothing here builds modules.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class EncoderConfig:
    input_size: int
    output_size: int
    attention_heads: int
    linear_units: int
    num_blocks: int
    num_up_blocks: int
    static_chunk_size: int  # in tokens; the upsampled stage uses static_chunk_size * up_stride
    pre_lookahead_len: int
    lookahead_channels: int  # width of the pre-lookahead convolution's hidden layer
    up_channels: int  # output width of the upsample convolution (must equal output_size)
    up_stride: int


@dataclass(frozen=True)
class EstimatorConfig:
    in_channels: int
    out_channels: int
    channels: int
    attention_head_dim: int
    num_heads: int
    n_blocks: int
    num_mid_blocks: int
    static_chunk_size: int  # in mel frames
    num_decoding_left_chunks: int  # < 0: every left chunk is visible


@dataclass(frozen=True)
class FlowConfig:
    vocab_size: int
    input_size: int
    output_size: int  # mel bins
    spk_embed_dim: int
    token_mel_ratio: int
    pre_lookahead_len: int
    n_timesteps: int
    t_scheduler: str
    inference_cfg_rate: float
    encoder: EncoderConfig
    estimator: EstimatorConfig


# The official CausalConditionalCFM call hard-codes 10 Euler steps in CausalMaskedDiffWithXvec.inference.
OFFICIAL_N_TIMESTEPS = 10


def _count_indexed(state: Mapping[str, torch.Tensor], prefix: str) -> int:
    pattern = re.compile(re.escape(prefix) + r"(\d+)\.")
    found = {int(m.group(1)) for key in state if (m := pattern.match(key))}
    return max(found) + 1 if found else 0


def _require(section: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in section:
        raise KeyError(f"flow yaml: missing `{where}.{key}`")
    return section[key]


def flow_config_from(yaml_cfg: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> FlowConfig:
    """Build the config from the parsed yaml (`load_model_yaml`) and the checkpoint's tensors."""
    flow = _require(yaml_cfg, "flow", "")
    enc = _require(flow, "encoder", "flow")
    dec = _require(flow, "decoder", "flow")
    est = _require(dec, "estimator", "flow.decoder")
    cfm = _require(_require(dec, "cfm_params", "flow.decoder"), "content", "flow.decoder.cfm_params")
    channels = list(_require(est, "channels", "flow.decoder.estimator"))
    if len(channels) != 1:
        # CosyVoice2 (tiny and full) uses one U-Net level: no strided down/up sampling in the estimator.
        raise ValueError(f"flow yaml: estimator.channels={channels}: only a single level is supported")
    for key, expected in (("pos_enc_layer_type", "rel_pos_espnet"), ("selfattention_layer_type", "rel_selfattn"),
                          ("input_layer", "linear")):
        if enc.get(key, expected) != expected:
            raise ValueError(f"flow yaml: encoder.{key}={enc[key]!r} is not supported (need {expected!r})")
    if enc.get("use_cnn_module", False) or enc.get("macaron_style", False) or not enc.get("normalize_before", True):
        raise ValueError("flow yaml: only the CosyVoice2 conformer variant (no cnn, no macaron, pre-norm) is supported")

    lookahead_w = state["encoder.pre_lookahead_layer.conv1.weight"]
    up_w = state["encoder.up_layer.conv.weight"]
    encoder = EncoderConfig(
        input_size=int(_require(enc, "input_size", "flow.encoder")),
        output_size=int(_require(enc, "output_size", "flow.encoder")),
        attention_heads=int(_require(enc, "attention_heads", "flow.encoder")),
        linear_units=int(_require(enc, "linear_units", "flow.encoder")),
        num_blocks=int(_require(enc, "num_blocks", "flow.encoder")),
        num_up_blocks=_count_indexed(state, "encoder.up_encoders."),
        static_chunk_size=int(enc.get("static_chunk_size", 0)),
        pre_lookahead_len=int(lookahead_w.shape[2]) - 1,
        lookahead_channels=int(lookahead_w.shape[0]),
        up_channels=int(up_w.shape[0]),
        up_stride=(int(up_w.shape[2]) - 1) // 2,
    )
    estimator = EstimatorConfig(
        in_channels=int(_require(est, "in_channels", "flow.decoder.estimator")),
        out_channels=int(_require(est, "out_channels", "flow.decoder.estimator")),
        channels=int(channels[0]),
        attention_head_dim=int(_require(est, "attention_head_dim", "flow.decoder.estimator")),
        num_heads=int(_require(est, "num_heads", "flow.decoder.estimator")),
        n_blocks=int(est.get("n_blocks", 1)),
        num_mid_blocks=int(est.get("num_mid_blocks", 2)),
        static_chunk_size=int(est.get("static_chunk_size", 0)),
        num_decoding_left_chunks=int(est.get("num_decoding_left_chunks", -1)),
    )
    config = FlowConfig(
        vocab_size=int(_require(flow, "vocab_size", "flow")),
        input_size=int(_require(flow, "input_size", "flow")),
        output_size=int(_require(flow, "output_size", "flow")),
        spk_embed_dim=int(_require(flow, "spk_embed_dim", "flow")),
        token_mel_ratio=int(_require(flow, "token_mel_ratio", "flow")),
        pre_lookahead_len=int(_require(flow, "pre_lookahead_len", "flow")),
        n_timesteps=OFFICIAL_N_TIMESTEPS,
        t_scheduler=str(cfm.get("t_scheduler", "cosine")),
        inference_cfg_rate=float(_require(cfm, "inference_cfg_rate", "flow.decoder.cfm_params")),
        encoder=encoder,
        estimator=estimator,
    )
    if encoder.pre_lookahead_len != config.pre_lookahead_len:
        raise ValueError(f"flow.pt: pre-lookahead kernel implies {encoder.pre_lookahead_len} tokens, "
                         f"yaml says pre_lookahead_len={config.pre_lookahead_len}")
    if encoder.up_stride != config.token_mel_ratio:
        raise ValueError(f"flow.pt: upsample kernel implies stride {encoder.up_stride}, "
                         f"yaml says token_mel_ratio={config.token_mel_ratio}")
    if config.t_scheduler not in ("cosine", "linear"):
        raise ValueError(f"flow yaml: t_scheduler={config.t_scheduler!r} is not supported")
    return config
