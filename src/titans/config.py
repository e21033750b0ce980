"""One configuration system for the whole library: pydantic models, loaded strictly.

Every config (model, task, training, experiment) derives from `Config`, a pydantic model that refuses unknown fields,
wrong types (strict: `true` is not an integer and "1" not a number; an integer is a float), NaN and infinity (`None`
is how a field says "no limit"), and values out of a field's bounds (`Field(ge=...)`). Each class's cross-field rules
are a `model_validator(mode="after")`. Assigning a field after construction runs the same checks. A refusal is a
`ConfigError` (a ValueError) with one line per problem, each naming the field's dotted path (`model.dim`), so a typo in
a YAML file never silently falls back to a default.

Pydantic does not read YAML: the loader (duplicate keys refused, `1e9` a number), the dotted overrides (`a.b=value`)
and the YAML round trip are here.
"""

from __future__ import annotations

import re
import types
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError


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
T = TypeVar("T")


def dotted_fields(data: dict[str, Any], opaque: frozenset[str] = frozenset(), prefix: str = "") -> dict[str, Any]:
    """A config's fields by dotted path (`model.attention.window`), its sections opened, but not those named in
    `opaque` (free-form mappings compared whole)."""
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key not in opaque:
            flat.update(dotted_fields(value, opaque, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _tuple_from_list(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


# A tuple field (`betas: FromList[tuple[float, float]]`) also takes a list: YAML and JSON have no tuples, and strict
# mode alone would refuse a list. The items are still checked strictly.
FromList = Annotated[T, BeforeValidator(_tuple_from_list)]


class ConfigError(ValueError):
    """A refused config: `problems` are (dotted path, what is wrong) pairs; str() is one line for each."""

    def __init__(self, problems: list[tuple[str, str]]):
        self.problems = problems
        super().__init__("\n".join(f"{path}: {what}" if path else what for path, what in problems))

    def under(self, prefix: str) -> ConfigError:
        """The same problems, found in a config that sits at `prefix` (a field's path, or a name such as `task x`)."""
        return ConfigError([(_joined(prefix, path), what) for path, what in self.problems])


def _joined(prefix: str, path: str) -> str:
    if not prefix or not path:
        return prefix or path
    return prefix + path if path.startswith("[") else f"{prefix}.{path}"


def _dotted(loc: tuple[int | str, ...]) -> str:
    return "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).removeprefix(".")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")


def _problems(err: ValidationError, cls: type[Config]) -> list[tuple[str, str]]:
    """Pydantic's errors in our words: (dotted path, what is wrong, with the value given)."""
    problems = []
    for error in err.errors(include_url=False):
        path, kind = _dotted(_without_union_tags(cls, error["loc"])), error["type"]
        if kind == "value_error":  # a model validator's rule: its message names the fields it involves
            problems.append((path, str(error["ctx"]["error"])))
        elif kind == "union_tag_invalid":  # a tagged union (a loss by `name`): a name it does not know
            ctx = error["ctx"]
            problems.append((path, f"{ctx['discriminator'].strip(chr(39))} must be one of {ctx['expected_tags']}, "
                                   f"got {ctx['tag']!r}"))
        elif kind == "union_tag_not_found":
            problems.append((path, f"needs its {error['ctx']['discriminator']}, got {_short(error['input'])}"))
        elif kind in ("extra_forbidden", "no_such_attribute"):  # in the data, or assigned to
            owner = _model_at(cls, error["loc"][:-1])
            valid = f"; valid fields: {', '.join(sorted(owner.model_fields))}" if owner else ""
            problems.append((path, f"unknown field{f' for {owner.__name__}' if owner else ''}{valid}"))
        elif kind == "frozen_instance":
            problems.append((path, f"cannot be changed: {cls.__name__} is read-only"))
        elif kind in ("too_short", "too_long"):  # a list or tuple with the wrong number of items
            ctx = error["ctx"]
            count = f"at least {ctx['min_length']}" if kind == "too_short" else f"at most {ctx['max_length']}"
            problems.append((path, f"expected {count} item(s), got {ctx['actual_length']}"))
        elif kind == "missing":  # every field has a default: an item a fixed-length tuple lacks
            problems.append((path, "missing"))
        elif kind == "float_type" and type(error["input"]) is int:  # an integer too large for a float
            problems.append((path, f"expected a finite number, got {_short(error['input'])}"))
        elif kind in _BOUND_ERRORS:
            bounds = _bounds(cls, error["loc"]) or error["ctx"]
            problems.append((path, f"must be {_range(bounds)}, got {_short(error['input'])}"))
        else:  # "Input should be a valid integer" -> "expected a valid integer, got True"
            what = re.sub(r"^Input should be ", "expected ", error["msg"])
            problems.append((path, f"{what}, got {_short(error['input'])}"))
    return problems


def _model_at(cls: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The config class of the value at `loc` inside a `cls` (through nested configs, lists, dicts and tagged unions,
    whose member the loc names by its tag), if any."""
    tp: Any = cls
    for part in loc:
        if isinstance(tp, type) and issubclass(tp, BaseModel) and part in tp.model_fields:
            tp = tp.model_fields[part].annotation
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]  # list[X] -> X, dict[K, X] -> X
        elif _tagged(tp) and part in _tagged(tp):
            tp = _tagged(tp)[part]
            continue
        else:
            return None
        if get_origin(tp) in (Union, types.UnionType) and not _tagged(tp):  # Optional[X] -> X
            tp = next(arg for arg in get_args(tp) if arg is not type(None))
    return tp if isinstance(tp, type) and issubclass(tp, BaseModel) else None


def _tagged(tp: Any) -> dict[str, type[BaseModel]]:
    """{tag: member} of a union of configs told apart by a `name` literal (a tagged union: `memory.loss`), else {}."""
    if get_origin(tp) not in (Union, types.UnionType):
        return {}
    members = [arg for arg in get_args(tp) if isinstance(arg, type) and issubclass(arg, BaseModel)]
    tags = {}
    for member in members:
        field = member.model_fields.get("name")
        if field is None or get_origin(field.annotation) is not Literal:
            return {}
        tags.update({tag: member for tag in get_args(field.annotation)})
    return tags


def _without_union_tags(cls: type[BaseModel], loc: tuple[int | str, ...]) -> tuple[int | str, ...]:
    """`loc` without the tags pydantic puts in it where it enters a tagged union (`memory.loss.huber.delta` ->
    `memory.loss.delta`): the member is the value's own `name`, not a level of the config."""
    kept = []
    for i, part in enumerate(loc):
        tp = _model_at(cls, loc[:i])
        if tp is None and i > 0 and _tagged(_field_type(cls, loc[:i])) and part in _tagged(_field_type(cls, loc[:i])):
            continue
        kept.append(part)
    return tuple(kept)


def _field_type(cls: type[BaseModel], loc: tuple[int | str, ...]) -> Any:
    """The annotation of the field at `loc` inside a `cls` (None where `loc` names no field)."""
    owner = _model_at(cls, loc[:-1])
    if owner is None or not isinstance(loc[-1], str) or loc[-1] not in owner.model_fields:
        return None
    return owner.model_fields[loc[-1]].annotation


def _bounds(cls: type[BaseModel], loc: tuple[int | str, ...]) -> dict[str, Any]:
    """The bounds of the field at `loc` as its `Field(...)` writes them (pydantic's errors show `gt=1` as 1.0)."""
    owner = _model_at(cls, loc[:-1])
    field = owner.model_fields.get(loc[-1]) if owner and isinstance(loc[-1], str) else None
    return {name: getattr(m, name) for m in (field.metadata if field else []) for name in _BOUNDS
            if getattr(m, name, None) is not None}


def _range(bounds: dict[str, Any]) -> str:
    """`in [0, 1)` where a field is bounded on both sides, so that the error shows the whole range; else `> 0`."""
    low, high = bounds.get("ge", bounds.get("gt")), bounds.get("le", bounds.get("lt"))
    if low is not None and high is not None:
        return f"in {'[' if 'ge' in bounds else '('}{low}, {high}{']' if 'le' in bounds else ')'}"
    name, value = next(iter(bounds.items()))
    return f"{_BOUNDS[name]} {value}"


_UNSET = object()


class Config(BaseModel):
    """Base class: strict validation (on construction and on assignment), `from_dict`/`to_dict`, YAML round trip."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_assignment=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(_problems(err, type(self))) from None

    # Pydantic would call an __init__ of ours for every nested config (`model: {dim: 8}`), each raising ConfigError
    # and losing the nested paths; marked as its own __init__, it builds nested configs itself and reports every
    # problem with its full path (`model.dim`). tests/test_config.py holds this to the nested paths.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]

    def __setattr__(self, name: str, value: Any) -> None:
        # validate_assignment checks the value, then re-runs the model validators with it already stored: where one
        # of those refuses it, the old value is put back, so that a refused assignment changes nothing.
        old = self.__dict__.get(name, _UNSET)
        try:
            super().__setattr__(name, value)
        except ValidationError as err:
            if old is not _UNSET:
                self.__dict__[name] = old
            raise ConfigError(_problems(err, type(self))) from None

    @classmethod
    def from_dict(cls: type[C], data: dict[str, Any], _path: str = "") -> C:
        """`data` checked into a `cls`; `_path` is put in front of the paths in errors (where `data` came from)."""
        if not isinstance(data, dict):
            raise ConfigError([(_path, f"expected a mapping for {cls.__name__}, got {type(data).__name__}")])
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            raise ConfigError(_problems(err, cls)).under(_path) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML/JSON types (tuples become lists), every field, in declaration order."""
        return self.model_dump(mode="json")

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
