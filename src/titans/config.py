"""One configuration system for the whole library: frozen-ish dataclasses, loaded strictly.

Every config (model, task, training) is a dataclass deriving from `Config`. Loading from a dict or
YAML rejects unknown fields and wrong types with a `ValueError` that names the field, so a typo in a
YAML file never silently falls back to a default.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e9` and `3.0e-4` as numbers: YAML 1.1 (PyYAML's) needs a dot and a
    signed exponent, so `lr: 1e-3` worked but `time_budget_s: 1e9` silently became a string. It rejects a
    key written twice in one mapping, which PyYAML resolves silently to the last value."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen = set()
        for key_node, _ in node.value:
            # Scalar keys only (all a config has); keys a `<<` merge brings in may be overridden, so it is skipped.
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (line {key_node.start_mark.line + 1})", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|\.[0-9_]+(?:[eE][-+]?[0-9]+)?"
               r"|[0-9][0-9_]*[eE][-+]?[0-9]+|\.(?:inf|Inf|INF)|[-+]\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass

C = TypeVar("C", bound="Config")


def _check_value(path: str, tp: Any, value: Any) -> Any:
    """Coerce/validate `value` against annotation `tp`; raise ValueError naming `path`."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        options = get_args(tp)
        if value is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _check_value(path, option, value)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {tp}")
    if origin is Literal:
        if value not in get_args(tp):
            allowed = ", ".join(repr(a) for a in get_args(tp))
            raise ValueError(f"{path}: {value!r} is not one of {allowed}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{path}: expected a list, got {type(value).__name__}")
        args = get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:  # tuple[X, Y]: exactly that many items
            if len(value) != len(args):
                raise ValueError(f"{path}: expected {len(args)} items, got {len(value)}")
            return tuple(_check_value(f"{path}[{i}]", t, v) for i, (t, v) in enumerate(zip(args, value)))
        item_tp = args[0] if args else Any
        items = [_check_value(f"{path}[{i}]", item_tp, v) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping, got {type(value).__name__}")
        key_tp, item_tp = get_args(tp) or (Any, Any)
        return {_check_value(f"{path} (a key)", key_tp, k): _check_value(f"{path}.{k}", item_tp, v)
                for k, v in value.items()}
    if isinstance(tp, type) and issubclass(tp, Config):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"{path}: expected a mapping for {tp.__name__}, got {type(value).__name__}")
        return tp.from_dict(value, _path=path)
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path}: expected true/false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{path}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{path}: expected a number, got {value!r}")
        _check_finite(path, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"{path}: expected a string, got {value!r}")
        return value
    return value


def _check_finite(path: str, value: float) -> None:
    """No field means anything by NaN or infinity (`None` is how a field says "no limit"), and NaN slips past
    range checks such as `x <= 0` in `validate`: every comparison with it is false."""
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer beyond the float range
        finite = False
    if not finite:
        raise ValueError(f"{path}: expected a finite number, got {value!r}")


@dataclasses.dataclass
class Config:
    """Base class: strict `from_dict`/`to_dict`/YAML round trip plus a `validate` hook."""

    def __post_init__(self) -> None:
        # `from_dict` checked the floats already, naming their full path; this covers direct construction.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float):
                _check_finite(field.name, value)
        self.validate()

    def validate(self) -> None:
        """Subclasses check ranges and cross-field rules here, raising ValueError naming the field."""

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], _path: str = "") -> C:
        if not isinstance(data, dict):
            raise ValueError(f"{_path or cls.__name__}: expected a mapping, got {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - names)
        if unknown:
            where = f"{_path}." if _path else ""
            raise ValueError(
                f"unknown field(s) {', '.join(where + u for u in unknown)} for {cls.__name__}; "
                f"valid fields: {', '.join(sorted(names))}"
            )
        kwargs = {}
        for key, value in data.items():
            field_path = f"{_path}.{key}" if _path else key
            kwargs[key] = _check_value(field_path, hints[key], value)
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        def convert(value: Any) -> Any:
            if isinstance(value, Config):
                return value.to_dict()
            if isinstance(value, (list, tuple)):
                return [convert(v) for v in value]
            if isinstance(value, dict):
                return {k: convert(v) for k, v in value.items()}
            return value

        return {f.name: convert(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self: C, **changes: Any) -> C:
        return type(self).from_dict({**self.to_dict(), **changes})

    @classmethod
    def from_yaml(cls: type[C], path: str | Path) -> C:
        return cls.from_dict(read_yaml_mapping(path))

    def to_yaml(self, path: str | Path) -> None:
        Path(path).write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))


def shipped_configs(kind: str) -> Path | None:
    """configs/<kind> (holding YAML files) in the working directory, else in the source checkout this package runs
    from; None where neither has one."""
    for root in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if any((root / "configs" / kind).glob("*.yaml")):
            return root / "configs" / kind
    return None


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of a YAML file; ValueError naming the file when it is missing or malformed."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"config file {path} is a directory, not a file")
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    try:
        data = load_yaml(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as err:
        raise ValueError(f"config file {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except yaml.YAMLError as err:
        raise ValueError(f"config file {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides (value parsed as YAML) to a nested dict, returning a new dict."""
    result = load_yaml(yaml.safe_dump(data))  # deep copy through plain types
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ValueError(f"override {item!r}: the key has an empty part; it must look like key.path=value")
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ValueError(f"override {key!r}: {part!r} is not a section")
            node = child
        try:
            node[parts[-1]] = load_yaml(raw)
        except yaml.YAMLError:  # not YAML (`pattern=*.py`, `name=[x`): the text itself, checked against the field
            node[parts[-1]] = raw
    return result
