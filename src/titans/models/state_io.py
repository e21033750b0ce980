"""Save and load recurrent states with safetensors, generically.

A state is any nesting of dataclasses, lists, tuples, tensors, ints, floats, bools and None (one
entry per block: memory states, KV caches, ...). Tensors go into the file under their path
("state.2.memory.weights.0"); ints, floats and bools become 0-d tensors the same way. The nesting
and the dataclass names ("module:QualName") go into the file's metadata as JSON, so a state saved
in one process loads bit-exactly in another. Only dataclasses defined inside `titans` are rebuilt:
a state file never makes us import arbitrary modules.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

METADATA_KEY = "titans_state"
_SCALARS = {"int": (int, torch.int64), "float": (float, torch.float64), "bool": (bool, torch.bool)}


def _flatten(obj: Any, path: str, tensors: dict[str, Tensor]) -> Any:
    if isinstance(obj, Tensor):
        # A private contiguous copy: states may hold the same tensor twice (MAC's memory at the segment
        # start is its current memory at a boundary) and safetensors refuses tensors that share storage.
        tensors[path] = obj.detach().clone(memory_format=torch.contiguous_format)
        return {"tensor": path}
    for kind, (py_type, dtype) in _SCALARS.items():
        if type(obj) is py_type:
            tensors[path] = torch.tensor(obj, dtype=dtype)
            return {kind: path}
    if obj is None:
        return {"none": None}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        fields = {f.name: _flatten(getattr(obj, f.name), f"{path}.{f.name}", tensors)
                  for f in dataclasses.fields(obj) if f.init}
        return {"dataclass": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
    if isinstance(obj, (list, tuple)):
        items = [_flatten(v, f"{path}.{i}", tensors) for i, v in enumerate(obj)]
        return {"tuple" if isinstance(obj, tuple) else "list": items}
    raise ValueError(f"cannot save a state holding {type(obj).__name__} at {path}")


def _state_class(name: str) -> type:
    module_name, _, qualname = name.partition(":")
    if not (module_name == "titans" or module_name.startswith("titans.")):
        raise ValueError(f"state class {name!r} is not a titans class; refusing to import it")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError):
        raise ValueError(f"state class {name!r} does not exist in this version of titans") from None
    if not (isinstance(obj, type) and dataclasses.is_dataclass(obj)):
        raise ValueError(f"state class {name!r} is not a dataclass")
    return obj


def _unflatten(node: dict, tensors: dict[str, Tensor]) -> Any:
    if "tensor" in node:
        return tensors[node["tensor"]]
    for kind, (py_type, _) in _SCALARS.items():
        if kind in node:
            return py_type(tensors[node[kind]].item())
    if "none" in node:
        return None
    if "dataclass" in node:
        cls = _state_class(node["dataclass"])
        return cls(**{k: _unflatten(v, tensors) for k, v in node["fields"].items()})
    if "tuple" in node:
        return tuple(_unflatten(v, tensors) for v in node["tuple"])
    if "list" in node:
        return [_unflatten(v, tensors) for v in node["list"]]
    raise ValueError(f"unreadable state node {sorted(node)}")


def save_state(state: Any, path: str | Path) -> None:
    """Write `state` (a model's recurrent state, or any nesting of the types above) to `path`."""
    tensors: dict[str, Tensor] = {}
    structure = _flatten(state, "state", tensors)
    save_file(tensors, str(path), metadata={METADATA_KEY: json.dumps(structure)})


def load_state(path: str | Path, device: str = "cpu") -> Any:
    """Read a state written by `save_state`, its tensors on `device`."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"state file {path} does not exist")
    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            metadata = f.metadata() or {}
            tensors = {key: f.get_tensor(key) for key in f.keys()}
    except (SafetensorError, OSError) as err:
        raise ValueError(f"state file {path} is not a readable safetensors file: {err}") from None
    if METADATA_KEY not in metadata:
        raise ValueError(f"{path} holds no titans state (metadata {METADATA_KEY!r} missing)")
    return _unflatten(json.loads(metadata[METADATA_KEY]), tensors)
