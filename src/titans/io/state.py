"""Save and load recurrent states with safetensors, generically.

A state is any nesting of dataclasses, lists, tuples, tensors, ints, floats, bools and None (one
entry per block: memory states, KV caches, ...). Tensors go into the file under their path
("state.2.memory.weights.0"); ints, floats and bools become 0-d tensors the same way. The nesting
and the dataclass names ("module:QualName") go into the file's metadata as JSON, so a state saved
in one process loads bit-exactly in another. Only dataclasses defined inside `titans` are rebuilt:
a state file never makes us import arbitrary modules.

Given the model's config, the file records it too, and loading with a config refuses a state saved by
another model: the states of MAG and MAL, or of two sizes of one variant, may have the same structure,
so only the record tells them apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from ..config import Config, dotted_fields

METADATA_KEY = "titans_state"
CONFIG_KEY = "titans_config"
_STATE_NEUTRAL = frozenset({"dropout"})  # config fields a state does not depend on
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


def state_nodes(state: Any) -> Iterator[Any]:
    """Every node of a state's nesting, depth first, each before what it holds: the state, its dataclasses, the items
    of its lists and tuples, and their tensors and scalars."""
    yield state
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        for f in dataclasses.fields(state):
            yield from state_nodes(getattr(state, f.name))
    elif isinstance(state, (list, tuple)):
        for item in state:
            yield from state_nodes(item)


def detached(state: Any) -> Any:
    """`state` with every tensor detached from the graph that computed it, in the same nesting: a stream continued
    from it sends no gradient into the past (truncated backpropagation through time)."""
    if isinstance(state, Tensor):
        return state.detach()
    if dataclasses.is_dataclass(state) and not isinstance(state, type):
        return dataclasses.replace(state, **{f.name: detached(getattr(state, f.name))
                                            for f in dataclasses.fields(state) if f.init})
    if isinstance(state, (list, tuple)):
        return type(state)(detached(v) for v in state)
    return state


def save_state(state: Any, path: str | Path, config: Optional[Config] = None, overwrite: bool = False) -> None:
    """Write `state` (a model's recurrent state, or any nesting of the types above) to `path`; with the
    model's `config` (`model.config`), record it so that `load_state` can check the state belongs to it.

    An existing file is refused unless `overwrite`. The file is written beside `path` and renamed over it at the
    end, so a write that fails (a state that cannot be saved, a full disk) leaves what was there before intact.
    """
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"state path {path} is a directory; give a file name (e.g. {path / 'state.safetensors'})")
    if path.exists() and not overwrite:
        raise ValueError(f"state file {path} already exists; pass overwrite=True to replace it")
    tensors: dict[str, Tensor] = {}
    structure = _flatten(state, "state", tensors)
    metadata = {METADATA_KEY: json.dumps(structure)}
    if config is not None:
        metadata[CONFIG_KEY] = json.dumps(_config_dict(config))
    with staged_writes(path) as (partial,):
        save_file(tensors, str(partial), metadata=metadata)


@contextlib.contextmanager
def staged_writes(*targets: Path) -> Iterator[list[Path]]:
    """Paths to write `targets` under (`.name.partial` beside each). They are renamed over the targets together once
    the block completes, and removed if it fails, so a save that fails leaves what was there before whole."""
    staged = [target.with_name(f".{target.name}.partial") for target in targets]
    try:
        yield staged
        for partial, target in zip(staged, targets):
            partial.replace(target)
    finally:
        for partial in staged:
            partial.unlink(missing_ok=True)


def _config_dict(config: Config) -> dict:
    if not isinstance(config, Config):
        raise ValueError(f"config must be a titans config (model.config), got {type(config).__name__}")
    return {"type": type(config).__name__, "fields": config.to_dict()}


def _check_config(path: Path, metadata: dict[str, str], config: Config) -> None:
    """The state in `path` was saved by a model with `config` (fields a state does not depend on aside)."""
    if CONFIG_KEY not in metadata:
        raise ValueError(f"{path} records no model config, so it cannot be checked against this model (saved "
                         "without save_state(..., config=model.config)?); load it without config= to skip the check")
    saved, ours = json.loads(metadata[CONFIG_KEY]), json.loads(json.dumps(_config_dict(config)))
    if saved["type"] != ours["type"]:
        raise ValueError(f"{path} holds the state of a {saved['type']} model, not of a {ours['type']}")
    try:  # a record written before a section was nested (flat names) reads as the config reads it today
        saved_fields = json.loads(json.dumps(type(config).from_dict(saved["fields"]).to_dict()))
    except (TypeError, ValueError):  # fields this version does not know: compared as they are, so they are named
        saved_fields = saved["fields"]
    saved_leaves, our_leaves = dotted_fields(saved_fields), dotted_fields(ours["fields"])
    names = sorted(n for n in set(saved_leaves) | set(our_leaves) if n.rsplit(".", 1)[-1] not in _STATE_NEUTRAL)
    differ = [n for n in names if saved_leaves.get(n) != our_leaves.get(n)]
    if differ:
        listed = ", ".join(f"{n}={saved_leaves.get(n)!r} (this model: {our_leaves.get(n)!r})" for n in differ)
        raise ValueError(f"{path} holds the state of another model: {listed}")



def load_state(path: str | Path, device: str = "cpu", config: Optional[Config] = None) -> Any:
    """Read a state written by `save_state`, its tensors on `device`. With `config` (`model.config`), refuse a
    state that was saved by a model with another config, or saved without one."""
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
    if config is not None:
        _check_config(path, metadata, config)
    return _unflatten(json.loads(metadata[METADATA_KEY]), tensors)
