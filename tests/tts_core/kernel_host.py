"""Where the Triton kernel tests run (test_decode_attention.py, test_dit_attention.py, test_flow_attention.py):
on a CUDA host for real; on CPU only under Triton's interpreter (TRITON_INTERPRET=1 set before Triton is
imported, with the `triton` package installed), which computes with numpy. CI's CPU torch has no Triton, so CI
skips them; a developer's CPU can run their fp32 cases (`pip install triton`, then
`TRITON_INTERPRET=1 pytest tests/tts_core/test_flow_attention.py`)."""

from __future__ import annotations

import os

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def skip_unless_kernels_run() -> None:
    """Call at a test module's top, before it imports a kernel module."""
    pytest.importorskip("triton")
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("Triton kernels run on CPU only under TRITON_INTERPRET=1", allow_module_level=True)


def precisions(fp32: float, bf16: float, fp16: float) -> list:
    """(dtype, tolerance) parameters: fp32 everywhere, the half precisions on the GPU only (numpy has no
    bfloat16, and the interpreter's fp16 is not the GPU's)."""
    gpu_only = pytest.mark.skipif(DEVICE == "cpu", reason="half precision: on the GPU only")
    return [pytest.param(torch.float32, fp32, id="fp32"),
            pytest.param(torch.bfloat16, bf16, id="bf16", marks=gpu_only),
            pytest.param(torch.float16, fp16, id="fp16", marks=gpu_only)]
