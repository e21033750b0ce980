"""TrainConfig: strict loading, overrides, the task check, resume compatibility, every shipped config."""

import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from titans.cli import app
from titans.models import TitansConfig
from titans.train import build_model, build_task, load_train_config
from titans.train.config import OptimConfig, resume_mismatches

ROOT = Path(__file__).resolve().parents[2]
# training configs; the recipes read token shards, and tests/train/test_recipes.py checks them
SHIPPED = sorted(p for p in (ROOT / "configs").rglob("*.yaml")
                 if p.parent.name != "experiments" and "recipes" not in p.parts)


def test_vocab_size_comes_from_the_task_unless_given(tiny_config):
    assert load_train_config(tiny_config).model.vocab_size == 24
    cfg = load_train_config(tiny_config, ["model.vocab_size=40", "steps=3", "train.batch_size=8"])
    assert (cfg.model.vocab_size, cfg.steps, cfg.batch_size) == (40, 3, 8)


@pytest.mark.parametrize("override, field", [
    ("model.dimm=3", "model.dimm"),
    ("stepz=3", "stepz"),
    ("steps=0", "steps"),
    ("steps=ten", "steps"),
    ("optim.lr=-1", "optim.lr"),
    ("optim.betas=[0.9, 1.5]", "optim.betas"),
    ("batch_size=5", "batch_size"),  # not divisible by grad_accum 2 below
    ("task.train_length=3", "task.train_length"),  # passkey needs 4 tokens
    ("task.eval_lengths=[]", "task.eval_lengths"),
    ("model.vocab_size=10", "model.vocab_size"),  # smaller than the task's 24 tokens
    ("device=tpu", "device"),
])
def test_bad_fields_are_named(tiny_config, override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        load_train_config(tiny_config, [override, "optim.grad_accum=2"])


@pytest.mark.parametrize("override, message", [
    *[(f"{field}={value}", rf"{field}: expected a finite number, got {value[1:]}")
      for field in ("optim.lr", "optim.weight_decay", "optim.grad_clip", "optim.eps", "model.memory.max_lr",
                    "model.mlp_ratio", "model.attention.rope_base", "time_budget_s")
      for value in (".nan", ".inf")],
    ("task.options.depth=.nan", r"task passkey\.depth: expected a finite number"),  # task options too
    ("optim.lr=1e400", r"optim\.lr: expected a finite number, got inf"),
    ("optim.lr=" + "9" * 400, r"optim\.lr: expected a finite number, got 9{77}\.\.\.$"),  # beyond the float range
    ("optim.betas=[.nan, 0.95]", r"optim\.betas\[0\]: expected a finite number"),
    # a flat name (configs written before the attention section) reads into its place, and the error names that place
    ("model.rope_base=1", r"^model\.attention\.rope_base: must be > 1, got 1$"),
    ("model.rope_base=0", "rope_base: must be > 1"),
    ("model.rope_base=-1", "rope_base: must be > 1"),
    ("seed=1180591620717411303424", r"^seed: must be in \[0, 9223372036854775807\], got 1180591620717411303424$"),
    ("seed=-1", r"seed: must be in \[0, 9223372036854775807\], got -1"),
    ("threads=100000", r"threads: must be in \[1, 1024\]"),
    ("model.vocab_size=1099511627776", r"model\.vocab_size: must be in \[1, 16777216\]"),
    ("model.memory.init_eta=1", r"model\.memory\.init_eta: must be in \(0, 1\), got 1"),
    # a flat name (configs written before the memory section) reads into its place, and the error names that place
    ("model.memory_init_eta=1", r"model\.memory\.init_eta: must be in \(0, 1\), got 1"),
    ("model.max_lr=.nan", r"model\.memory\.max_lr: expected a finite number, got nan"),
    ("model.memory.loss.name=hubr", r"model\.memory\.loss: name must be one of 'squared', 'huber', 'lp', got 'hubr'"),
    ("model.memory.loss={name: huber, delta: 0}", r"model\.memory\.loss\.delta: must be > 0, got 0"),
    ("optim.betas=[0.9]", r"optim\.betas\[1\]: missing"),
    ("optim.betas=[0.9, 0.9, 0.9]", r"optim\.betas: expected at most 2 item\(s\), got 3"),
    ("model.heads=3", r"^model: dim \(16\) must be divisible by heads \(3\)$"),  # a rule between fields
    ("=3", "override '=3': the key has an empty part"),
    ("model..dim=3", "override 'model..dim=3': the key has an empty part"),
    ("model.=3", "override 'model.=3': the key has an empty part"),
])
def test_non_finite_out_of_range_and_malformed_values_are_named(tiny_config, override, message):
    with pytest.raises(ValueError, match=message):
        load_train_config(tiny_config, [override])


def test_limits_themselves_are_accepted(tiny_config):
    cfg = load_train_config(tiny_config, ["seed=9223372036854775807", "threads=1024", "name=run_2.b-c",
                                          "model.rope_base=1.5", "model.vocab_size=16777216"])
    assert (cfg.seed, cfg.threads, cfg.run_name, cfg.model.attention.rope_base) == (2**63 - 1, 1024, "run_2.b-c", 1.5)
    # an empty name is the default: the run is named after the variant
    unnamed = {**yaml.safe_load(tiny_config.read_text()), "name": ""}
    assert load_train_config(data=unnamed).run_name == "lmm"


@pytest.mark.parametrize("make, field", [
    (lambda: TitansConfig(mlp_ratio=float("nan")), "mlp_ratio"),
    (lambda: TitansConfig(variant="swa", mlp_ratio=float("inf")), "mlp_ratio"),
    (lambda: TitansConfig(rope_base=float("nan")), "attention.rope_base"),  # the flat name, read into its section
    (lambda: OptimConfig(lr=float("inf")), "lr"),
    (lambda: OptimConfig(weight_decay=float("nan")), "weight_decay"),
])
def test_non_finite_values_are_rejected_on_direct_construction(make, field):
    with pytest.raises(ValueError, match=f"^{field}: expected a finite number"):
        make()


@pytest.mark.parametrize("content, message", [
    (b"steps: 2\nsteps: 3\n", r"is not valid YAML: duplicate key 'steps' \(line 2\)"),
    (b"optim: {lr: 0.1, lr: 0.2}\n", r"is not valid YAML: duplicate key 'lr' \(line 1\)"),
    (b"\xff\xfe\x00steps: 2\n", "is not UTF-8 text"),
], ids=["duplicate key", "duplicate nested key", "binary"])
def test_bad_config_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=f"config file {re.escape(str(path))} {message}"):
        load_train_config(path)


def test_yaml_merge_keys_may_still_be_overridden(tmp_path, tiny_config):
    path = tmp_path / "merged.yaml"
    path.write_text(tiny_config.read_text().replace("optim: {lr: 0.01,", "optim: {<<: {lr: 0.01}, lr: 0.02,"))
    assert load_train_config(path).optim.lr == 0.02


def test_a_directory_is_not_a_config_file(tmp_path):
    with pytest.raises(ValueError, match=f"config file {re.escape(str(tmp_path))} is a directory, not a file"):
        load_train_config(tmp_path)
    result = CliRunner().invoke(app, ["train", str(tmp_path)])
    assert result.exit_code == 2 and "is a directory, not a file" in result.stderr, result.output


@pytest.mark.parametrize("name", ["../victim", "/abs", "a/b", r"a\b", ".", "..", ".x", "a b"])
def test_a_run_name_must_be_one_plain_path_component(tiny_config, name, tmp_path):
    cfg = load_train_config(tiny_config, [f"name={name}"])  # loads: an old checkpoint's config may carry any name
    with pytest.raises(ValueError, match="name must be letters, digits"):
        cfg.run_dir_in(tmp_path)
    assert load_train_config(tiny_config, ["name=run_2.b-c"]).run_dir_in(tmp_path) == tmp_path / "run_2.b-c"


def test_demo_refuses_a_name_that_leaves_its_folder(tmp_path, tiny_config):
    data = yaml.safe_load(tiny_config.read_text())
    path = tmp_path / "escape.yaml"
    path.write_text(yaml.safe_dump({**data, "name": "../victim"}))
    result = CliRunner().invoke(app, ["demo", "--out", str(tmp_path / "demo"), "--configs", str(path)])
    assert result.exit_code == 2 and "name must be letters" in result.stderr, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["escape.yaml"]


def test_unknown_task_and_option_are_named(tiny_config):
    with pytest.raises(ValueError, match="unknown task 'chess'"):
        load_train_config(tiny_config, ["task.name=chess"])
    with pytest.raises(ValueError, match="volume"):
        load_train_config(tiny_config, ["task.options.volume=3"])


def test_resume_allows_longer_runs_but_not_another_model(tiny_config):
    saved = load_train_config(tiny_config)
    assert resume_mismatches(saved, load_train_config(tiny_config, ["steps=60", "task.eval_lengths=[96]"])) == []
    changed = resume_mismatches(saved, load_train_config(tiny_config, ["model.dim=32", "seed=1", "optim.lr=0.1"]))
    assert changed == ["model.dim (16 -> 32)", "optim.lr (0.01 -> 0.1)", "seed (0 -> 1)"]


def test_every_shipped_config_builds_its_model_and_task():
    assert len(SHIPPED) >= 15
    for path in SHIPPED:
        cfg = load_train_config(path)
        task = build_task(cfg)
        model = build_model(cfg, task)
        assert sum(p.numel() for p in model.parameters()) > 1000, path
    names = [load_train_config(p).run_name for p in SHIPPED]
    assert len(set(names)) == len(names), "two shipped configs would share the run directory runs/<name>"


def test_shipped_configs_cover_the_results_matrix():
    names = {(p.parent.name, load_train_config(p).model.variant, load_train_config(p).task.name) for p in SHIPPED}
    for variant in ("lmm", "mac", "mag", "mal", "transformer", "swa", "gated_deltanet", "lstm"):
        assert ("mqar", variant, "mqar") in names
    for variant in ("lmm", "mac", "swa"):
        assert ("passkey", variant, "passkey") in names
    assert {("lm", "mac", "lm_bytes"), ("lm", "transformer", "lm_bytes")} <= names
    assert any(task == "forecast_sine" for _, _, task in names)


def test_demo_pair_shares_task_and_window_and_has_similar_size():
    configs = [load_train_config(p) for p in SHIPPED if p.parent.name == "demo"]
    assert len(configs) == 2 and {c.model.variant for c in configs} in ({"lmm", "swa"}, {"mac", "swa"})
    assert len({(c.task.name, c.task.train_length, tuple(c.task.eval_lengths)) for c in configs}) == 1
    assert len({c.model.attention.window for c in configs}) == 1
    assert any("swa" in c.run_name for c in configs)
    train_length = configs[0].task.train_length
    assert configs[0].task.eval_lengths == [train_length, 2 * train_length, 4 * train_length, 8 * train_length]
    torch.manual_seed(0)
    sizes = [sum(p.numel() for p in build_model(c, build_task(c)).parameters()) for c in configs]
    assert max(sizes) <= 1.15 * min(sizes), sizes
