"""TitansConfig's `attention:` section: the window, MAC's segment, the persistent tokens and RoPE's base in one place,
and the flat names of configs written before it (checkpoints, config.json format 3 and earlier, results JSONs,
experiment YAMLs, dotted overrides) read into it."""

import json

import pytest
import torch
import yaml

from titans import TitansConfig, TitansLM
from titans.experiments.spec import merge, model_field
from titans.io.pretrained import FORMAT_VERSION
from titans.models.config import FLAT_ATTENTION_FIELDS, AttentionConfig, nest_flat_fields, with_earlier_defaults
from titans.train.checkpoint import load_checkpoint_config
from titans.train.config import load_train_config

FLAT = {"window": 8, "segment_len": 4, "n_persistent": 2, "rope_base": 500.0}


def test_the_section_holds_the_attention_fields_written_nested():
    config = TitansConfig()
    assert isinstance(config.attention, AttentionConfig) and config.attention == AttentionConfig()
    assert set(FLAT_ATTENTION_FIELDS) == set(FLAT) and set(FLAT_ATTENTION_FIELDS.values()) == set(
        AttentionConfig.model_fields)
    written = config.to_dict()
    assert written["attention"] == AttentionConfig().to_dict() and not set(FLAT) & set(written)


def test_every_flat_name_reads_into_its_place():
    config = TitansConfig(**FLAT)
    assert config == TitansConfig(attention=FLAT) == TitansConfig.from_dict({"attention": FLAT})
    for flat, value in FLAT.items():
        assert getattr(config.attention, FLAT_ATTENTION_FIELDS[flat]) == value, flat
        assert model_field(config.to_dict(), flat) == value == model_field(FLAT, f"attention.{flat}")


def test_a_flat_field_beside_its_nested_twin_wins_and_merges_nest_first():
    assert TitansConfig(attention={"window": 16, "segment_len": 4}, window=8).attention.window == 8
    assert TitansConfig(attention={"window": 16, "segment_len": 4}, window=8).attention.segment_len == 4
    config = TitansConfig(attention={"window": 16, "n_persistent": 0})
    assert config.replace(window=8).attention == config.attention.replace(window=8)
    assert config.replace(attention={"segment_len": 4}).attention == config.attention.replace(segment_len=4)
    assert merge({"model": {"window": 2}}, {"model": {"attention": {"window": 3}}})["model"]["attention"]["window"] == 3
    merged = merge({"model": {"attention": {"window": 3}}}, {"model": {"window": 1, "n_persistent": 0}})["model"]
    assert merged["attention"] == {"window": 1, "n_persistent": 0}
    both = nest_flat_fields({"dim": 8, "window": 4, "memory_depth": 1})
    assert both == {"dim": 8, "attention": {"window": 4}, "memory": {"depth": 1}}
    assert nest_flat_fields({"dim": 8}) == {"dim": 8}


def test_a_yaml_file_and_its_overrides_in_either_spelling(tmp_path):
    flat = tmp_path / "flat.yaml"
    flat.write_text(yaml.safe_dump({"model": {"variant": "mag", "window": 8, "n_persistent": 2},
                                    "task": {"name": "passkey"}}))
    nested = tmp_path / "nested.yaml"
    nested.write_text(yaml.safe_dump({"model": {"variant": "mag", "attention": {"window": 8, "n_persistent": 2}},
                                      "task": {"name": "passkey"}}))
    for path in (flat, nested):
        assert load_train_config(path).model == load_train_config(nested).model
        for override in ("model.attention.window=3", "model.window=3"):
            cfg = load_train_config(path, [override])
            assert (cfg.model.attention.window, cfg.model.attention.n_persistent) == (3, 2), (path.name, override)


def test_an_old_checkpoint_config_reads_into_the_section(tmp_path):
    """A checkpoint's config.yaml (and a results JSON's record) written before the section holds the fields flat."""
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(
        {"model": {"variant": "mac", "dim": 16, "heads": 1, **FLAT, "memory_depth": 1}, "task": {"name": "passkey"}}))
    model = load_checkpoint_config(tmp_path).model
    assert model.attention == AttentionConfig(**FLAT) and model.memory.depth == 1
    assert with_earlier_defaults({"window": 3})["attention"] == {"window": 3}


@pytest.mark.parametrize("version", [1, 2, 3])
def test_a_config_json_of_an_earlier_version_loads_the_same_model(tmp_path, version):
    """Format 4 writes the attention section; 3 and earlier wrote its fields flat (1 the memory's too)."""
    torch.manual_seed(0)
    model = TitansLM(TitansConfig(variant="mac", vocab_size=32, dim=16, heads=2, **FLAT, memory_depth=1,
                                  memory={"chunk_size": 2}))
    model.save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    data = json.loads(path.read_text())
    assert data["titans_format_version"] == FORMAT_VERSION == 4 and data["titans"]["attention"] == FLAT
    section = {**{key: value for key, value in data["titans"].items() if key != "attention"}, **FLAT}
    path.write_text(json.dumps({**data, "titans_format_version": version, "titans": section}))
    again = TitansLM.from_pretrained(tmp_path)
    assert again.config == model.config
    x = torch.randint(0, 32, (1, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(again(x)[0], model(x)[0])


@pytest.mark.parametrize("bad, message", [
    ({"attention": {"windw": 2}}, "attention.windw: unknown field for AttentionConfig"),
    ({"window": 0}, r"attention\.window: must be >= 1, got 0"),
    ({"attention": {"rope_base": 1}}, r"attention\.rope_base: must be > 1, got 1"),
    ({"attention": "wide"}, "attention: expected"),
])
def test_bad_sections_name_the_field(bad, message):
    with pytest.raises(ValueError, match=message):
        TitansConfig.from_dict(bad)
