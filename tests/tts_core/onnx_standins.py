"""Small stand-ins for CosyVoice2's two frontend ONNX models, with the same input/output signature.

The real `campplus.onnx` maps a Kaldi fbank (1, T, 80) to a speaker embedding (1, 192); the real
`speech_tokenizer_v2.onnx` maps a Whisper log-mel (1, 128, T) and its length (1,) int32 to speech
tokens (1, T/4) at 25 Hz. These stand-ins compute deterministic functions of their input with the
same names, shapes and dtypes, so voice registration runs the real onnxruntime path in tests.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def write_campplus_standin(path: Path, seed: int = 1) -> Path:
    projection = np.random.default_rng(seed).standard_normal((80, 192)).astype(np.float32) * 0.1
    graph = helper.make_graph(
        [
            helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[1], keepdims=0),
            helper.make_node("MatMul", ["pooled", "projection"], ["embedding"]),
        ],
        "campplus_standin",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [1, "T", 80])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, [1, 192])],
        [numpy_helper.from_array(projection, "projection")],
    )
    return _save(graph, path)


def write_speech_tokenizer_standin(path: Path, codebook: int = 6561, seed: int = 2) -> Path:
    """Every 4th mel frame (100 Hz -> 25 Hz) projected to `codebook` logits, argmax -> token."""
    projection = np.random.default_rng(seed).standard_normal((128, codebook)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("Transpose", ["feats"], ["frames"], perm=[0, 2, 1]),
            helper.make_node("Slice", ["frames", "starts", "ends", "axes", "steps"], ["strided"]),
            helper.make_node("MatMul", ["strided", "projection"], ["logits"]),
            helper.make_node("ArgMax", ["logits"], ["tokens64"], axis=2, keepdims=0),
            helper.make_node("Cast", ["tokens64"], ["indices"], to=TensorProto.INT32),
        ],
        "speech_tokenizer_standin",
        [
            helper.make_tensor_value_info("feats", TensorProto.FLOAT, [1, 128, "T"]),
            helper.make_tensor_value_info("feats_length", TensorProto.INT32, [1]),
        ],
        [helper.make_tensor_value_info("indices", TensorProto.INT32, [1, "N"])],
        [
            numpy_helper.from_array(projection, "projection"),
            numpy_helper.from_array(np.array([0], np.int64), "starts"),
            numpy_helper.from_array(np.array([2**62], np.int64), "ends"),
            numpy_helper.from_array(np.array([1], np.int64), "axes"),
            numpy_helper.from_array(np.array([4], np.int64), "steps"),
        ],
    )
    return _save(graph, path)


def model_dir_for_enrolment(model_dir: Path, target: Path) -> Path:
    """A copy of `model_dir` at `target` with both stand-ins written into it (voice enrolment runs there)."""
    shutil.copytree(model_dir, target)
    write_campplus_standin(target / "campplus.onnx")
    version = 3 if (target / "cosyvoice3.yaml").is_file() else 2  # CosyVoice3 ships speech_tokenizer_v3.onnx
    write_speech_tokenizer_standin(target / f"speech_tokenizer_v{version}.onnx")
    return target
