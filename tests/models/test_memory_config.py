"""TitansConfig's `memory:` section: the memory's rule and structure in one place, and the flat names of configs written
before it (checkpoints, config.json format 1, results JSONs, experiment YAMLs, dotted overrides) read into it."""

import pytest
import yaml

from titans import TitansConfig
from titans.experiments.spec import merge, model_field
from titans.memory import Huber, MemoryRule
from titans.models.config import (
    EARLIER_DEFAULTS,
    FLAT_MEMORY_FIELDS,
    MAC_SWITCHES,
    MemoryConfig,
    nest_flat_fields,
    with_earlier_defaults,
)
from titans.train.config import load_train_config


def test_the_section_is_the_rule_and_the_structure():
    config = TitansConfig()
    assert isinstance(config.memory, MemoryConfig) and isinstance(config.memory.rule, MemoryRule)
    assert config.memory.rule == MemoryRule()  # the section's defaults are the rule's
    assert set(MemoryConfig.model_fields) == set(MemoryRule.model_fields) | {
        "depth", "expansion", "heads", "chunk_size", "learned_init", "conv_kernel"}
    assert set(FLAT_MEMORY_FIELDS.values()) <= set(MemoryConfig.model_fields)
    assert "memory" in config.to_dict() and not set(FLAT_MEMORY_FIELDS) & set(config.to_dict())  # written nested
    assert TitansConfig(memory=MemoryRule(loss="huber")).memory.loss == Huber()  # a rule alone: default structure


def test_every_flat_name_reads_into_its_place():
    values = {"memory_depth": 3, "memory_expansion": 2, "memory_heads": 2, "chunk_size": 8, "max_lr": 0.5,
              "memory_init_theta": 0.1, "memory_init_eta": 0.3, "memory_init_alpha": 1e-3, "memory_max_grad_norm": 2.0,
              "memory_max_state_norm": 5.0, "memory_normalize_inputs": False, "memory_normalize_chunk": False,
              "memory_activation": "silu", "momentum": False, "memory_forgetting": False,
              "memory_forgetting_channels": True, "memory_gates": "data", "memory_residual": True,
              "memory_hidden_step": 0.5, "memory_max_momentum_step": None, "memory_learned_init": False,
              "gate_pooling": "chunk", "surprise_gate": True, "conv_kernel": 2}
    assert set(values) == set(FLAT_MEMORY_FIELDS)
    config = TitansConfig(**values)
    for flat, value in values.items():
        assert getattr(config.memory, FLAT_MEMORY_FIELDS[flat]) == value, flat
        assert model_field(config.to_dict(), flat) == value == model_field(values, f"memory.{FLAT_MEMORY_FIELDS[flat]}")


def test_a_flat_field_beside_its_nested_twin_wins_and_merges_nest_first():
    """One mapping: the flat spelling is the more specific change (`replace(memory_depth=1)` lays it over a complete
    section). Two mappings laid one over the other (a file and its overrides, an experiment's base and its rows): both
    are nested first, so the later wins however either spells the field."""
    assert TitansConfig(memory={"depth": 3, "chunk_size": 8}, memory_depth=1).memory.depth == 1
    assert TitansConfig(memory={"depth": 3, "chunk_size": 8}, memory_depth=1).memory.chunk_size == 8
    config = TitansConfig(memory={"depth": 3, "loss": "huber"})
    assert config.replace(memory_depth=1).memory.depth == 1
    assert config.replace(memory={"chunk_size": 4}).memory == config.memory.replace(chunk_size=4)  # merged, not reset
    assert merge({"model": {"memory_depth": 2}}, {"model": {"memory": {"depth": 3}}})["model"]["memory"]["depth"] == 3
    assert merge({"model": {"memory": {"depth": 3}}}, {"model": {"memory_depth": 1}})["model"]["memory"]["depth"] == 1
    assert nest_flat_fields({"dim": 8}) == {"dim": 8}


def test_a_yaml_file_and_its_overrides_in_either_spelling(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"model": {"variant": "lmm", "memory_depth": 2, "chunk_size": 8},
                                    "task": {"name": "passkey"}}))
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model": {"variant": "lmm", "memory": {"depth": 2, "chunk_size": 8}},
                                      "task": {"name": "passkey"}}))
    for path in (flat, nested):
        assert load_train_config(path).model == load_train_config(nested).model
        for override in ("model.memory.depth=3", "model.memory_depth=3"):
            cfg = load_train_config(path, [override])
            assert (cfg.model.memory.depth, cfg.model.memory.chunk_size) == (3, 8), (path.name, override)


def test_earlier_defaults_fill_old_records_only():
    """A record written flat, before a default changed, lacks the field: it gets the value it was trained with. A
    record that holds the field (flat or nested) keeps it, and a nested config holding every field gets nothing."""
    assert set(EARLIER_DEFAULTS) == {"memory.residual", "memory.max_momentum_step", *MAC_SWITCHES}
    old = with_earlier_defaults({"variant": "lmm", "memory_depth": 1})
    assert old["memory"] == {"depth": 1, "residual": True, "max_momentum_step": None}
    assert TitansConfig.from_dict(old).memory.residual is True
    mac = TitansConfig.from_dict(with_earlier_defaults({"variant": "mac"}))  # MAC in the paper's order until issue 47
    assert not any(getattr(mac, switch) for switch in MAC_SWITCHES)
    assert all(getattr(TitansConfig(variant="mac"), switch) for switch in MAC_SWITCHES)  # today's default: all on
    one = with_earlier_defaults({"variant": "mac", "mac_residual_read": True})  # a field it holds is kept
    assert one["mac_residual_read"] is True and one["mac_write_input"] is False
    kept = with_earlier_defaults({"variant": "lmm", "memory_residual": False, "memory_max_momentum_step": 0.5})
    assert (kept["memory"]["residual"], kept["memory"]["max_momentum_step"]) == (False, 0.5)
    current = TitansConfig().to_dict()
    assert with_earlier_defaults(current) == current
    partial = with_earlier_defaults({"memory": {"residual": False}})
    assert partial["memory"] == {"residual": False, "max_momentum_step": None}


@pytest.mark.parametrize("bad, message", [
    ({"memory": {"depht": 2}}, "memory.depht: unknown field for MemoryConfig"),
    ({"memory_depth": 0}, r"memory\.depth: must be >= 1, got 0"),
    ({"memory": {"heads": 3}}, r"memory\.heads \(3\) must divide dim"),
    ({"memory": {"loss": {"name": "huber", "delta": -1}}}, r"memory\.loss\.delta: must be > 0, got -1"),
    ({"memory": "deep"}, "memory: expected"),
])
def test_bad_sections_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        TitansConfig.from_dict(bad)
