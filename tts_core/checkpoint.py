"""Load official checkpoint files into our modules with strict, named key checking.

A fine-tuned checkpoint must load exactly: every missing, unexpected or misshapen key is reported by
name. Older HiFT files use `weight_g/weight_v` weight norm, newer ones PyTorch's parametrization
keys, and some prefix every key with `generator.`; `normalize_hift_keys` maps all to one layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn


class CheckpointMismatch(ValueError):
    pass


def read_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    try:
        # Memory-mapped: tensors are read from the page cache as they are copied to the module
        # (on its device), not first into host memory of their own.
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError:  # a checkpoint in torch's legacy (pre-zip) format cannot be mapped
        state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, Mapping):
        raise CheckpointMismatch(f"{path}: expected a state dict, got {type(state).__name__}")
    return dict(state)


def load_strict(module: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> None:
    """Copy `state` into `module`, failing with every offending key named."""
    expected = module.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    misshapen = sorted(
        f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}"
        for k in set(expected) & set(state)
        if tuple(state[k].shape) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing keys: {', '.join(missing[:20])}" + (" ..." if len(missing) > 20 else ""))
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected[:20])}" + (" ..." if len(unexpected) > 20 else ""))
    if misshapen:
        problems.append(f"misshapen keys: {'; '.join(misshapen[:20])}")
    if problems:
        raise CheckpointMismatch(f"{source}: " + " | ".join(problems))
    module.load_state_dict(state, strict=True)


def normalize_hift_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip a `generator.` prefix and turn `weight_g/weight_v` into parametrization keys."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.startswith("generator."):
            key = key[len("generator."):]
        if key.endswith(".weight_g"):
            key = key[: -len(".weight_g")] + ".parametrizations.weight.original0"
        elif key.endswith(".weight_v"):
            key = key[: -len(".weight_v")] + ".parametrizations.weight.original1"
        out[key] = value
    return out
