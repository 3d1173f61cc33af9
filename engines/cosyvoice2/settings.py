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
        for key in ("max_batch", "max_len", "hop_tokens", "max_hop_tokens"):
            if key in values and int(values[key]) <= 0:
                raise ValueError(f"engine.cosyvoice2.{key}: must be positive")
        return cls(**values)

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
