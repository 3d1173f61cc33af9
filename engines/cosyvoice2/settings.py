"""The `engine.cosyvoice2` config block, validated into a typed value; errors name the key.

Device and dtype resolve here ("auto" -> what the host has) so the rest of the engine sees concrete
choices. torch is imported inside `resolve` only: reading a config must not need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "auto": "auto"}
DEVICES = ("auto", "cpu", "cuda")
# Measured on the H100 (bench/results/load_2026-11-22.json): 25 tokens of left context keep a later
# chunk's flow call to one fixed, graphable shape; the mel differs from the exact flow by ~1.6 %
# (relative, tiny model), see tests/tts_core/test_runtime_window_flow.py.
DEFAULT_GPU_FLOW_WINDOW = 25


@dataclass(frozen=True)
class CosyVoice2Settings:
    model_dir: Path
    device: str = "auto"
    dtype: str = "auto"
    voices_dir: Path | None = None
    default_voice: str | None = None  # None: the first voice by name
    max_batch: int = 8
    max_len: int = 2048
    hop_tokens: int = 25
    max_hop_tokens: int = 50
    first_hop_tokens: int | None = None
    seed: int | None = None  # fixed: every request replays the same draws (tests); None: random per request
    warmup: bool = True
    # The GPU fast path (tts_core.runtime): CUDA graphs for decode, prefill, flow and HiFT, and a
    # flow that sees the voice prompt plus the last `flow_window_tokens` spoken tokens, batched
    # across streams. None = auto: on for CUDA. With graphs off, or flow_window_tokens 0, the flow
    # is the exact official-equal streaming path (cost grows with the utterance; CPU default).
    graphs: bool | None = None
    flow_window_tokens: int | None = None

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> CosyVoice2Settings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"engine.cosyvoice2: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if not raw.get("model_dir"):
            raise ValueError("engine.cosyvoice2.model_dir: required (a CosyVoice2 model directory)")
        values = dict(raw)
        values["model_dir"] = Path(values["model_dir"])
        if values.get("voices_dir") is not None:
            values["voices_dir"] = Path(values["voices_dir"])
        device = str(values.get("device", "auto"))
        if device not in DEVICES and not device.startswith("cuda:"):
            raise ValueError(f"engine.cosyvoice2.device: {device!r}; choose auto, cpu, cuda or cuda:N")
        dtype = str(values.get("dtype", "auto"))
        if dtype not in DTYPES:
            raise ValueError(f"engine.cosyvoice2.dtype: {dtype!r}; choose one of {', '.join(DTYPES)}")
        values["device"], values["dtype"] = device, DTYPES[dtype]
        if values.get("flow_window_tokens") is not None and int(values["flow_window_tokens"]) < 0:
            raise ValueError("engine.cosyvoice2.flow_window_tokens: must be >= 0 (0 = exact flow)")
        for key in ("max_batch", "max_len", "hop_tokens", "max_hop_tokens"):
            if key in values and int(values[key]) <= 0:
                raise ValueError(f"engine.cosyvoice2.{key}: must be positive")
        return cls(**values)

    def fast_path(self, device: str) -> tuple[bool, int | None]:
        """(graphs, flow window in tokens or None for the exact flow) for the resolved device."""
        on_cuda = device.startswith("cuda")
        graphs = on_cuda if self.graphs is None else self.graphs
        if graphs and not on_cuda:
            raise ValueError("engine.cosyvoice2.graphs: CUDA graphs need device cuda")
        window = self.flow_window_tokens
        if window is None:
            window = DEFAULT_GPU_FLOW_WINDOW if graphs else 0
        return graphs, (window or None)

    def resolve(self) -> tuple[str, Any]:
        """(device, torch dtype): auto device = cuda if available; auto dtype = bf16 on CUDA that has
        it, else fp16 on CUDA, float32 on CPU (CPU half precision is slower, not faster)."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"engine.cosyvoice2.device: {device} requested but CUDA is not available")
        if self.dtype != "auto":
            return device, getattr(torch, self.dtype)
        if device.startswith("cuda"):
            return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return device, torch.float32
