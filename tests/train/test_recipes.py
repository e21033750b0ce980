"""The recipes (configs/recipes): the paper's settings where it gives them (Table 5, §E.1), the nominal parameter
counts, 0.5M tokens a step; each tiny CPU version trains a few steps on shards the suite prepares; `titans recipes`
prints and writes what it counts."""

import json
import math
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from titans.cli import app
from titans.train import load_train_config, train
from titans.train.recipes import recipe_files, summarise

RECIPES = Path(__file__).resolve().parents[2] / "configs" / "recipes"
VARIANTS = {"lmm", "mac", "mag", "mal", "transformer"}
# Table 5 of the paper (blocks, width, heads, peak learning rate, billions of tokens); 400M has no row (see its YAML)
TABLE_5 = {"170m": (12, 768, 16, 3e-3, 15), "340m": (24, 1024, 16, 1.5e-3, 15), "760m": (24, 1536, 16, 1.25e-3, 30)}
runner = CliRunner()


@pytest.mark.parametrize("size", ["170m", "340m", "400m", "760m"])
def test_each_size_has_every_variant_at_the_papers_settings(size):
    rows = [summarise(path) for path in sorted((RECIPES / size).glob("*.yaml"))]
    assert {r["variant"] for r in rows} == VARIANTS and len(rows) == len(VARIANTS)
    nominal = int(size[:-1]) * 1e6
    for r in rows:
        assert abs(r["parameters"] - nominal) / nominal < 0.02, r  # the size its name says
        assert r["tokens_per_step"] == 524_288 and r["train_length"] == 4096  # §E.1: 0.5M tokens, 4K
        assert r["vocab_size"] == 32_000 and r["weight_decay"] == 0.1 and not r["decay_gates"]
        assert r["batch_size"] % r["grad_accum"] == 0 and r["warmup_steps"] < r["steps"]
        blocks, width, heads, lr, billions = TABLE_5.get(size, TABLE_5["340m"])
        assert (r["depth"], r["dim"], r["heads"], r["lr"]) == (blocks, width, heads, lr)
        assert r["tokens"] == pytest.approx(billions * 1e9, rel=1e-4)
        cfg = load_train_config(r["recipe"], ["task.name=passkey", "task.options={}"])  # every field valid, no data
        attention = cfg.model.attention
        assert (attention.segment_len, attention.window, attention.n_persistent, cfg.model.memory.chunk_size) == \
            (512, 2048, 128, 16)  # §E.1


def test_tiny_recipes_train_on_prepared_shards(token_shards, tmp_path, one_thread):
    tiny = sorted((RECIPES / "tiny").glob("*.yaml"))
    assert {p.stem for p in tiny} == VARIANTS
    for path in tiny:
        cfg = load_train_config(path, [f"task.options.data={token_shards['dir']}", "steps=2", "checkpoint_every=0",
                                       "eval_batches=1", "eval_batch_size=2", "task.eval_lengths=[128]",
                                       "tensorboard=false"])
        assert cfg.optim.grad_accum == 2 and not cfg.optim.decay_gates  # accumulation and decay as the big ones
        assert cfg.model.vocab_size == 320  # from the shards
        result = train(cfg, tmp_path / path.stem, quiet=True)
        metrics = result.evaluation[128]
        assert result.step == 2 and math.isfinite(result.final_loss)
        assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
        assert 0 < metrics["bits_per_byte"] < math.log2(320) * 2  # a model that has seen 4K tokens, in bits a byte


def test_recipes_command_counts_from_the_yaml(tmp_path):
    out = tmp_path / "recipes.json"
    result = runner.invoke(app, ["recipes", str(RECIPES), "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["recipes"]
    assert len(rows) == len(recipe_files(RECIPES)) == 25
    mac = next(r for r in rows if r["recipe"].endswith("340m/mac.yaml"))
    from titans import TitansConfig, TitansLM

    with torch.device("meta"):
        model = TitansLM(TitansConfig(variant="mac", vocab_size=32000, dim=1024, depth=24, heads=16, segment_len=512,
                                      window=2048, n_persistent=128, memory={"chunk_size": 16}, mlp_ratio=1.25))
    assert mac["parameters"] == model.num_parameters()
    assert "340m/mac.yaml" in result.stdout and "339.5M" in result.stdout
