"""The `engine.cosyvoice2` config block, validated into a typed value; errors name the key.

Device and dtype resolve here ("auto" -> what the host has) so the rest of the engine sees concrete
choices. torch is imported inside `resolve` only: reading a config must not need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engines.base import EngineSettingsError

DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16", "auto": "auto"}
DEVICES = ("auto", "cpu", "cuda")
# Tokens the flow encoder re-reads before each chunk on the GPU: one graphable call shape for every
# non-final chunk; 25 moved the mel by 0.2 % (docs/PERF_NOTES.md). 0 means every token (exact).
DEFAULT_GPU_ENCODER_TOKENS = 50
MEL_FRAMES_PER_S = 50

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
    # None: 50 for CosyVoice2 (measured: docs/PERF_NOTES.md), the official 100 for CosyVoice3, whose every
    # chunk re-renders the utterance so far (a larger hop means fewer re-renders).
    max_hop_tokens: int | None = None
    # None: the official first hop (hop_tokens + the prompt's pad to a 25-token chunk; 28 decode steps to the
    # first audio with the lookahead). Fewer: the first audio N + 3 steps in, its chunk rendered from a partial
    # attention chunk (later frames unchanged); measured in docs/PERF_NOTES.md ("A shorter first hop").
    first_hop_tokens: int | None = None
    # Fixed: every request's flow and vocoder noise is the same (tests; the token draws are batched on
    # the device and do not follow it); None: random per request.
    seed: int | None = None
    warmup: bool = True
    # The GPU fast path (tts_core.runtime): CUDA graphs for decode, prefill, flow and HiFT. None =
    # auto: on for CUDA. The flow computes every mel frame once, batched across streams, from a
    # context pool on the device (tts_core.flow.pooled): exact for the first `flow_context_s` seconds
    # of each text segment (memory: ~28 MB per second per stream slot in bf16), then it keeps the
    # latest seconds. `flow_context_int8` (CosyVoice2): that context as int8 codes + a scale a frame,
    # ~14.5 MB per second per slot, so twice the slots fit, for a small mel movement (docs/PERF_NOTES.md,
    # "The flow context in int8"). `flow_encoder_tokens`: None = auto (50 with graphs, every token without).
    graphs: bool | None = None
    flow_context_s: float = 14.0
    flow_context_int8: bool = False
    flow_encoder_tokens: int | None = None
    # With graphs, what each trades is in tts_core/runtime/settings.py (figures: docs/PERF_NOTES.md):
    compile_flow: bool = True  # compiled flow (after ready, while serving): faster first chunks
    compile_hift: bool = True  # compiled HiFT stages (after ready): ~1.7x faster vocoder
    slot_attention: bool = True  # decode attention by slot in one Triton kernel (decode step 14-31 % faster)
    first_chunk_lanes: int = 3  # render lanes for first chunks only, each with its own graphs; 0: one lane
    # The LM's decoder-layer weights in FP8 (e4m3; CPU, or CUDA 8.9+): slower than bf16 on the H100 and
    # it moves the token distribution (docs/PERF_NOTES.md); try it on your own weights and listen first.
    llm_fp8: bool = False
    # Shedding: while a live stream's listener has been out of audio for more than this many seconds (the runtime
    # behind real time), the engine takes no new stream (a call gets 503 before it is answered) until it has caught
    # up: overload turns into refused calls rather than silence in every call. None (null): off. At 600 calls of 30 s
    # arriving at 10/s on an H200, 0.5 s cut the silence in an answered call from ~6.3 s to ~1 s for 40 more 503s
    # of 600 (docs/PERF_NOTES.md, "Shed calls, not speech").
    shed_late_s: float | None = 0.5

    @classmethod
    def from_config(cls, raw: Mapping[str, Any]) -> CosyVoice2Settings:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"engine.cosyvoice2: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if not raw.get("model_dir"):
            raise ValueError("engine.cosyvoice2.model_dir: required (a CosyVoice2 or CosyVoice3 model directory)")
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
        if values.get("flow_encoder_tokens") is not None and int(values["flow_encoder_tokens"]) < 0:
            raise ValueError("engine.cosyvoice2.flow_encoder_tokens: must be >= 0 (0 = every token, exact)")
        if "flow_context_s" in values and not 1.0 <= float(values["flow_context_s"]) <= 300.0:
            raise ValueError("engine.cosyvoice2.flow_context_s: must be between 1 and 300 seconds")
        for key in ("llm_fp8", "compile_flow", "compile_hift", "slot_attention", "flow_context_int8"):
            if key in values and not isinstance(values[key], bool):
                raise ValueError(f"engine.cosyvoice2.{key}: {values[key]!r}; use true or false")
        if "first_chunk_lanes" in values and (isinstance(values["first_chunk_lanes"], bool)
                                              or not isinstance(values["first_chunk_lanes"], int)
                                              or not 0 <= values["first_chunk_lanes"] <= 8):
            raise ValueError(f"engine.cosyvoice2.first_chunk_lanes: {values['first_chunk_lanes']!r}; "
                             "a whole number from 0 (one lane renders everything) to 8")
        shed = values.get("shed_late_s")
        if shed is not None and (isinstance(shed, bool) or not isinstance(shed, (int, float)) or shed <= 0):
            raise ValueError(f"engine.cosyvoice2.shed_late_s: {shed!r}; seconds > 0, or null (off)")
        for key in ("max_batch", "max_len", "hop_tokens", "max_hop_tokens", "first_hop_tokens"):
            if values.get(key) is not None and int(values[key]) <= 0:
                raise ValueError(f"engine.cosyvoice2.{key}: must be positive")
        return cls(**values)

    def fast_path(self, device: str) -> tuple[bool, int | None]:
        """(graphs, encoder window in tokens or None for every token) for the resolved device."""
        on_cuda = device.startswith("cuda")
        graphs = on_cuda if self.graphs is None else self.graphs
        if graphs and not on_cuda:
            raise ValueError("engine.cosyvoice2.graphs: CUDA graphs need device cuda")
        window = self.flow_encoder_tokens
        if window is None:
            window = DEFAULT_GPU_ENCODER_TOKENS if graphs else 0
        return graphs, (window or None)

    def max_hop_for(self, family: int) -> int:
        """`max_hop_tokens`, or the family's default."""
        if self.max_hop_tokens is not None:
            return self.max_hop_tokens
        return 100 if family == 3 else 50

    @property
    def flow_context_frames(self) -> int:
        return round(self.flow_context_s * MEL_FRAMES_PER_S)

    def resolve(self) -> tuple[str, Any]:
        """(device, torch dtype): auto device = cuda if available; auto dtype = bf16 on CUDA that has
        it, else fp16 on CUDA, float32 on CPU (CPU half precision is slower, not faster)."""
        import torch

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise EngineSettingsError("engine.cosyvoice2.device", device, "requested but CUDA is not available "
                                      "on this host (use cpu or auto)")
        if self.llm_fp8:
            from tts_core.accel.fp8_linear import fp8_unsupported_reason

            reason = fp8_unsupported_reason(device)
            if reason is not None:
                raise EngineSettingsError("engine.cosyvoice2.llm_fp8", True, f"cannot be used here: {reason}")
        if self.dtype != "auto":
            return device, getattr(torch, self.dtype)
        if device.startswith("cuda"):
            return device, torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return device, torch.float32


def check_settings(raw: Mapping[str, Any]) -> None:
    """The config-load check (engines.registry.check_settings): the same rules as at start, nothing loaded."""
    CosyVoice2Settings.from_config(raw)
