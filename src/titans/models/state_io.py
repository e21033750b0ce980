"""Save and load recurrent states (nested dataclasses, lists, tuples of tensors) with safetensors.

The tensors go into the safetensors file under their path ("2.memory.weights.0"); the nesting,
the dataclass names and the integers go into its metadata as JSON, so a state saved from one
process loads bit-exactly in another.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

_STATE_CLASSES: dict[str, type] = {}


def register_state(cls: type) -> type:
    _STATE_CLASSES[cls.__name__] = cls
    return cls


def _flatten(obj: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, Tensor):
        tensors[path] = obj.detach().contiguous()
        return {"tensor": path}
    if dataclasses.is_dataclass(obj):
        fields = {f.name: _flatten(getattr(obj, f.name), f"{path}.{f.name}", tensors) for f in dataclasses.fields(obj)}
        return {"dataclass": type(obj).__name__, "fields": fields}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
        return {"tuple" if isinstance(obj, tuple) else "list": items}
    if obj is None or isinstance(obj, (int, float, bool, str)):
        return {"value": obj}
    raise ValueError(f"cannot save a state holding {type(obj).__name__} at {path or 'the top'}")


def _unflatten(node: dict, tensors: dict[str, Tensor]) -> Any:
    if "tensor" in node:
        return tensors[node["tensor"]]
    if "dataclass" in node:
        cls = _STATE_CLASSES.get(node["dataclass"])
        if cls is None:
            raise ValueError(f"unknown state class {node['dataclass']!r} in the state file")
        return cls(**{k: _unflatten(v, tensors) for k, v in node["fields"].items()})
    if "tuple" in node:
        return tuple(_unflatten(v, tensors) for v in node["tuple"])
    if "list" in node:
        return [_unflatten(v, tensors) for v in node["list"]]
    return node["value"]


def save_state(state: Any, path: str | Path) -> None:
    tensors: dict[str, Tensor] = {}
    structure = _flatten(state, "state", tensors)
    save_file(tensors, str(path), metadata={"titans_state": json.dumps(structure)})


def load_state(path: str | Path, device: str = "cpu") -> Any:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"state file {path} does not exist")
    try:
        tensors = load_file(str(path), device=device)
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"state file {path} is not a readable safetensors file: {err}") from None
    if "titans_state" not in metadata:
        raise ValueError(f"{path} holds no titans state (metadata 'titans_state' missing)")
    return _unflatten(json.loads(metadata["titans_state"]), tensors)
