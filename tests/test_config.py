import dataclasses
from typing import Literal, Optional

import pytest

from titans.config import Config, apply_overrides


@dataclasses.dataclass
class Inner(Config):
    size: int = 4
    names: tuple[str, ...] = ()
    pair: tuple[float, int] = (0.5, 1)


@dataclasses.dataclass
class Outer(Config):
    kind: Literal["a", "b"] = "a"
    rate: float = 0.5
    limit: Optional[int] = None
    inner: Inner = dataclasses.field(default_factory=Inner)

    def validate(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")


def test_round_trip_through_yaml(tmp_path):
    cfg = Outer(kind="b", rate=2, limit=3, inner=Inner(size=7, names=("x", "y")))
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    again = Outer.from_yaml(path)
    assert again == cfg
    assert isinstance(again.rate, float) and again.inner.names == ("x", "y")


@pytest.mark.parametrize(
    "data, field",
    [
        ({"kind": "c"}, "kind"),
        ({"rate": "fast"}, "rate"),
        ({"inner": {"size": 1.5}}, "inner.size"),
        ({"inner": {"sise": 1}}, "inner.sise"),
        ({"speed": 1}, "speed"),
        ({"limit": True}, "limit"),
        ({"inner": {"pair": [0.5]}}, "inner.pair: expected 2 items"),
        ({"inner": {"pair": [0.5, 1, 2]}}, "inner.pair: expected 2 items"),
        ({"inner": {"pair": [0.5, 1.5]}}, r"inner.pair\[1\]"),
    ],
)
def test_bad_fields_are_named(data, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        Outer.from_dict(data)


def test_validate_hook_runs_on_construction():
    with pytest.raises(ValueError, match="rate"):
        Outer(rate=-1.0)


def test_overrides_parse_yaml_values():
    data = apply_overrides({"inner": {"size": 1}}, ["inner.size=8", "rate=0.25", "inner.names=[p, q]"])
    cfg = Outer.from_dict(data)
    assert cfg.inner.size == 8 and cfg.rate == 0.25 and cfg.inner.names == ("p", "q")
    with pytest.raises(ValueError, match="key.path=value"):
        apply_overrides({}, ["nonsense"])
    # text that is not YAML is the text itself, then checked against the field like any other value
    assert apply_overrides({}, ["inner.names=[*.py]", "kind=*.py", "limit=[oops"]) == \
        {"inner": {"names": "[*.py]"}, "kind": "*.py", "limit": "[oops"}
    assert apply_overrides({}, ["pattern=*.py"]) == {"pattern": "*.py"}
    with pytest.raises(ValueError, match="limit"):
        Outer.from_dict(apply_overrides({}, ["limit=[oops"]))


@pytest.mark.parametrize("text, number", [("1e9", 1e9), ("1.0e9", 1e9), ("3e-4", 3e-4), ("2.5E+3", 2500.0),
                                          (".5", 0.5), ("7", 7)])
def test_exponent_numbers_are_numbers(text, number, tmp_path):
    # PyYAML alone reads `1e9` as the string "1e9" (YAML 1.1 wants `1.0e+9`)
    assert apply_overrides({}, [f"rate={text}"])["rate"] == number
    path = tmp_path / "c.yaml"
    path.write_text(f"rate: {text}\n")
    assert Outer.from_yaml(path).rate == number


def test_missing_or_malformed_yaml(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        Outer.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("kind: [unclosed")
    with pytest.raises(ValueError, match="not valid YAML"):
        Outer.from_yaml(bad)
