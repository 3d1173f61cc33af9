"""Read an official `cosyvoice2.yaml` as data.

The official file is HyperPyYAML: `!new:pkg.Class` builds an object, `!name:pkg.func` binds a
function, `!apply:f [args]` calls one, `!ref <key>` points at another key (optionally inside a small
arithmetic expression such as `<chunk_size> * <token_mel_ratio>`). We never import or call anything
it names. Tags become plain dicts so the hyper-parameters can be read:

    !new:a.B {k: v}   ->  {"_new": "a.B", "k": v}
    !name:a.f {k: v}  ->  {"_name": "a.f", "k": v}
    !apply:a.f [..]   ->  {"_apply": "a.f", "args": [..]}
    !ref <x>          ->  the value of top-level key x (after resolution)
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path
from typing import Any

import yaml


class _Ref:
    def __init__(self, expr: str) -> None:
        self.expr = expr


class _Loader(yaml.SafeLoader):
    pass


def _tagged(kind: str):
    def construct(loader: yaml.Loader, suffix: str, node: yaml.Node) -> Any:
        if isinstance(node, yaml.MappingNode):
            value = loader.construct_mapping(node, deep=True)
        elif isinstance(node, yaml.SequenceNode):
            value = loader.construct_sequence(node, deep=True)
        else:
            scalar = loader.construct_scalar(node)
            value = {} if scalar in ("", None) else scalar
        if kind == "_apply":
            return {"_apply": suffix, "args": value}
        out = {kind: suffix}
        if isinstance(value, dict):
            out.update(value)
        elif value not in ({}, None):
            out["args"] = value
        return out

    return construct


_Loader.add_multi_constructor("!new:", _tagged("_new"))
_Loader.add_multi_constructor("!name:", _tagged("_name"))
_Loader.add_multi_constructor("!apply:", _tagged("_apply"))
_Loader.add_constructor("!ref", lambda loader, node: _Ref(loader.construct_scalar(node)))

_REF = re.compile(r"<([^<>]+)>")
_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv}


def _arith(expr: str) -> Any:
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression in !ref: {expr!r}")

    return ev(ast.parse(expr, mode="eval"))


def _resolve(value: Any, top: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if isinstance(value, _Ref):
        names = _REF.findall(value.expr)
        whole = _REF.fullmatch(value.expr.strip())
        resolved = {n: _lookup(n, top, stack) for n in names}
        if whole:
            return resolved[names[0]]
        return _arith(_REF.sub(lambda m: repr(resolved[m.group(1)]), value.expr))
    if isinstance(value, dict):
        return {k: _resolve(v, top, stack) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve(v, top, stack) for v in value]
    return value


def _lookup(name: str, top: dict[str, Any], stack: tuple[str, ...]) -> Any:
    if name in stack:
        raise ValueError(f"circular !ref through {' -> '.join(stack + (name,))}")
    node: Any = top
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"!ref <{name}> names no key of the yaml")
        node = node[part]
    return _resolve(node, top, stack + (name,))


def load_model_yaml(path: str | Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Parse the yaml into plain data with every `!ref` resolved. `overrides` replace top-level keys
    before resolution (the official loader overrides `qwen_pretrain_path` the same way)."""
    text = Path(path).read_text(encoding="utf-8")
    raw = yaml.load(text, Loader=_Loader)  # noqa: S506 - our loader only builds plain data
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    raw.update(overrides or {})
    return {k: _resolve(v, raw, (k,)) for k, v in raw.items()}
