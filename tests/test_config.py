import math
from typing import Literal, Optional

import pytest
from pydantic import Field, model_validator

from titans.config import Config, ConfigError, FromList, apply_overrides
from titans.models import TitansConfig
from titans.train import TrainConfig


class Inner(Config):
    size: int = Field(4, ge=1)
    names: FromList[tuple[str, ...]] = ()
    pair: FromList[tuple[float, int]] = (0.5, 1)


class Outer(Config):
    kind: Literal["a", "b"] = "a"
    rate: float = Field(0.5, gt=0)
    limit: Optional[int] = None
    inner: Inner = Field(default_factory=Inner)
    inners: dict[str, Inner] = Field(default_factory=dict)

    @model_validator(mode="after")
    def check_rules(self) -> "Outer":
        if self.kind == "b" and self.limit is None:
            raise ValueError("kind 'b' needs a limit")
        return self


def test_round_trip_through_yaml(tmp_path):
    cfg = Outer(kind="b", rate=2, limit=3, inner=Inner(size=7, names=("x", "y")), inners={"p": Inner(size=2)})
    path = tmp_path / "c.yaml"
    cfg.to_yaml(path)
    again = Outer.from_yaml(path)
    assert again == cfg
    assert isinstance(again.rate, float) and again.inner.names == ("x", "y")
    assert cfg.to_dict()["inner"]["pair"] == [0.5, 1]  # plain YAML types: tuples are written as lists


def test_shipped_configs_round_trip_through_yaml(tmp_path):
    cfg = TrainConfig(model=TitansConfig(variant="mag", memory_init_theta=0.3), name="x", time_budget_s=1e9)
    cfg.to_yaml(tmp_path / "config.yaml")
    assert TrainConfig.from_yaml(tmp_path / "config.yaml") == cfg


@pytest.mark.parametrize(
    "data, message",
    [
        ({"kind": "c"}, "^kind: expected 'a' or 'b', got 'c'$"),
        ({"rate": "fast"}, "^rate: expected a valid number, got 'fast'$"),
        ({"rate": "1"}, "^rate: expected a valid number, got '1'$"),  # strings are not read as numbers
        ({"rate": True}, "^rate: expected a valid number, got True$"),
        ({"rate": math.nan}, "^rate: expected a finite number, got nan$"),
        ({"rate": -math.inf}, "^rate: expected a finite number, got -inf$"),
        ({"rate": 0}, "^rate: must be > 0, got 0$"),
        ({"limit": True}, "^limit: expected a valid integer, got True$"),
        ({"limit": "1"}, "^limit: expected a valid integer, got '1'$"),
        ({"limit": 1.0}, "^limit: expected a valid integer, got 1.0$"),
        ({"inner": {"size": 1.5}}, r"^inner\.size: expected a valid integer, got 1\.5$"),
        ({"inner": {"size": 0}}, r"^inner\.size: must be >= 1, got 0$"),
        ({"inner": 3}, r"^inner: expected a valid dictionary or instance of Inner, got 3$"),
        ({"inners": {"q": {"size": 0}}}, r"^inners\.q\.size: must be >= 1, got 0$"),
        ({"inner": {"sise": 1}}, r"^inner\.sise: unknown field for Inner; valid fields: names, pair, size$"),
        ({"inners": {"q": {"sise": 1}}}, r"^inners\.q\.sise: unknown field for Inner; valid fields: names, "),
        ({"speed": 1}, "^speed: unknown field for Outer; valid fields: inner, inners, kind, limit, rate$"),
        ({"inner": {"pair": [0.5]}}, r"^inner\.pair\[1\]: missing$"),
        ({"inner": {"pair": [0.5, 1, 2]}}, r"^inner\.pair: expected at most 2 item\(s\), got 3$"),
        ({"inner": {"pair": [0.5, 1.5]}}, r"^inner\.pair\[1\]: expected a valid integer, got 1\.5$"),
        ({"kind": "b"}, "^kind 'b' needs a limit$"),  # a rule between fields
    ],
)
def test_bad_fields_are_named(data, message):
    with pytest.raises(ConfigError, match=message):
        Outer.from_dict(data)


def test_every_problem_is_reported_on_its_own_line():
    with pytest.raises(ConfigError) as info:
        Outer.from_dict({"kind": "c", "inner": {"size": 0, "sise": 1}})
    assert str(info.value).splitlines() == [
        "kind: expected 'a' or 'b', got 'c'",
        "inner.size: must be >= 1, got 0",
        "inner.sise: unknown field for Inner; valid fields: names, pair, size",
    ]
    assert isinstance(info.value, ValueError) and len(info.value.problems) == 3


def test_ints_are_floats_and_a_path_prefix_names_where_the_data_came_from():
    assert Outer.from_dict({"rate": 2}).rate == 2.0 and isinstance(Outer.from_dict({"rate": 2}).rate, float)
    with pytest.raises(ConfigError, match=r"^task x\.inner\.size: must be >= 1, got 0$"):
        Outer.from_dict({"inner": {"size": 0}}, _path="task x")
    with pytest.raises(ConfigError, match="^task x: expected a mapping for Outer, got list$"):
        Outer.from_dict([1], _path="task x")


def test_direct_construction_is_checked_like_loading():
    with pytest.raises(ConfigError, match="^rate: must be > 0, got -1.0$"):
        Outer(rate=-1.0)
    with pytest.raises(ConfigError, match=r"^inner\.size: must be >= 1, got 0$"):
        Outer(inner={"size": 0})
    with pytest.raises(ConfigError, match="^kind 'b' needs a limit$"):
        Outer(kind="b")


def test_nested_errors_name_the_full_path():
    with pytest.raises(ValueError, match=r"^model\.dim: must be >= 1, got -1$"):
        TrainConfig.from_dict({"model": {"dim": -1}})
    with pytest.raises(ValueError, match=r"^optim\.betas\[1\]: must be < 1.0, got 1.5$"):
        TrainConfig.from_dict({"optim": {"betas": [0.9, 1.5]}})
    with pytest.raises(ValueError, match=r"^model: dim \(30\) must be divisible by heads \(4\)$"):
        TrainConfig.from_dict({"model": {"dim": 30}})


def test_assignment_is_checked_and_a_refused_value_changes_nothing():
    cfg = Outer()
    cfg.rate = 3  # accepted, as a float
    assert cfg.rate == 3.0 and isinstance(cfg.rate, float)
    for name, value, message in [("rate", math.nan, "^rate: expected a finite number"),
                                 ("rate", "2", "^rate: expected a valid number"),
                                 ("limit", True, "^limit: expected a valid integer"),
                                 ("kind", "b", "^kind 'b' needs a limit$"),  # the rules between fields too
                                 ("speed", 1, "^speed: unknown field for Outer; valid fields: inner, ")]:
        with pytest.raises(ConfigError, match=message):
            setattr(cfg, name, value)
    assert cfg == Outer(rate=3)
    cfg.inner.size = 9
    with pytest.raises(ConfigError, match=r"^size: must be >= 1, got 0$"):
        cfg.inner.size = 0
    with pytest.raises(ConfigError, match=r"^inner\.size: must be >= 1, got 0$"):
        cfg.inner = {"size": 0}
    assert cfg.inner.size == 9


def test_model_and_train_configs_check_assignments():
    model = TitansConfig()
    with pytest.raises(ValueError, match=r"^dim \(130\) must be divisible by heads \(4\)$"):
        model.dim = 130
    with pytest.raises(ValueError, match=r"^dropout: must be in \[0, 1\), got 1.0$"):
        model.dropout = 1.0
    with pytest.raises(ValueError, match=r"^memory: init_theta must be in \(0, max_lr = 1.0\), got 2.0$"):
        model.memory = {"init_theta": 2.0}
    with pytest.raises(ValueError, match="^memory_depth: unknown field for TitansConfig"):  # flat names are read, not
        model.memory_depth = 1  # attributes: the section's fields are (model.memory.depth)
    assert model == TitansConfig()
    train = TrainConfig()
    with pytest.raises(ValueError, match=r"^batch_size \(16\) must be divisible by optim\.grad_accum \(3\)$"):
        train.optim = {"grad_accum": 3}
    with pytest.raises(ValueError, match=r"^model\.heads: must be >= 1, got 0$"):
        train.model = {"heads": 0}
    assert train == TrainConfig()


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
    twice = tmp_path / "twice.yaml"
    twice.write_text("rate: 1\nrate: 2\n")
    with pytest.raises(ValueError, match=r"duplicate key 'rate' \(line 2\)"):
        Outer.from_yaml(twice)
