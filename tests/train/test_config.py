"""TrainConfig: strict loading, overrides, the task check, resume compatibility, every shipped config."""

from pathlib import Path

import pytest
import torch

from titans.train import build_model, build_task, load_train_config
from titans.train.config import resume_mismatches

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = sorted((ROOT / "configs").rglob("*.yaml"))


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
    assert len({c.model.window for c in configs}) == 1
    assert any("swa" in c.run_name for c in configs)
    train_length = configs[0].task.train_length
    assert configs[0].task.eval_lengths == [train_length, 2 * train_length, 4 * train_length, 8 * train_length]
    torch.manual_seed(0)
    sizes = [sum(p.numel() for p in build_model(c, build_task(c)).parameters()) for c in configs]
    assert max(sizes) <= 1.15 * min(sizes), sizes
