"""`titans bench generate` at toy sizes: one row per variant, the transformer's ratio 1, ops counted; bad options."""

import json

import torch
from typer.testing import CliRunner

from titans.bench.generate import format_table, measure_generation, ops_per_token
from titans.cli import app
from titans.models import TitansConfig, TitansLM, lm

TINY = {"vocab_size": 32, "dim": 16, "depth": 1, "heads": 2, "window": 4, "segment_len": 4}


def test_rows_per_variant_with_the_ratio_to_the_transformer():
    rows = measure_generation(TINY, ["transformer", "mac"], prompt_len=6, new_tokens=3, rounds=1)
    assert [r["variant"] for r in rows] == ["transformer", "mac"]
    assert rows[0]["vs_transformer"] == rows[0]["cpu_vs_transformer"] == 1.0
    for row in rows:
        assert row["tokens_per_s"] > 0 and row["ops_per_token"] > 0 and row["num_parameters"] > 0
        for rate, ratio in (("tokens_per_s", "vs_transformer"), ("tokens_per_cpu_s", "cpu_vs_transformer")):
            assert abs(row[ratio] - row[rate] / rows[0][rate]) < 1e-9


def test_compiled_rows_follow_the_eager_ones(monkeypatch):
    """With `compile`, every variant is measured a second time through generate(compile=True), its ratio taken to the
    eager transformer. The step is not really compiled here (tests/models/test_generate_compile.py compiles one):
    the eager step stands in for it, so only the bench's bookkeeping is under test."""
    monkeypatch.setattr(lm, "_compiled_logits", lambda: TitansLM._logits)
    rows = measure_generation(TINY, ["transformer", "lmm"], prompt_len=6, new_tokens=3, rounds=1, compile=True)
    assert [(r["variant"], r["compiled"]) for r in rows] == [
        ("transformer", False), ("lmm", False), ("transformer", True), ("lmm", True)]
    for row in rows:
        for rate, ratio in (("tokens_per_s", "vs_transformer"), ("tokens_per_cpu_s", "cpu_vs_transformer")):
            assert abs(row[ratio] - row[rate] / rows[0][rate]) < 1e-9
        assert (row["ops_per_token"] is None) == row["compiled"] == ("compile_s" in row)
    table = format_table(rows).splitlines()
    assert len(table) == 5 and "compiled" in table[3] and table[3].split()[-2] == "-"


def test_ops_are_counted_per_token():
    model = TitansLM(TitansConfig(variant="lmm", **TINY)).eval()

    prompt = torch.zeros(1, 5, dtype=torch.long)
    one, ops = ops_per_token(model, prompt, 1)
    two, _ = ops_per_token(model, prompt, 2)
    assert one == sum(ops.values()) and ("aten.addmm" in ops or "aten.mm" in ops)
    assert 0.5 * one < two < 2 * one  # a constant-size state: about the same work for every token


def test_cli_prints_the_table_and_writes_json(tmp_path):
    out = tmp_path / "generate.json"
    result = CliRunner().invoke(app, ["bench", "generate", "--variants", "transformer,lmm", "--prompt-len", "4",
                                      "--new-tokens", "2", "--rounds", "1", "--threads", "1", "--out", str(out),
                                      *[f"--set=model.{k}={v}" for k, v in TINY.items()]])
    assert result.exit_code == 0, result.output
    assert "vs transformer" in result.output and "lmm" in result.output
    data = json.loads(out.read_text())
    assert [r["variant"] for r in data["rows"]] == ["transformer", "lmm"] and data["model"]["dim"] == 16


def test_cli_rejects_an_unknown_variant():
    result = CliRunner().invoke(app, ["bench", "generate", "--variants", "mac,gpt"])
    assert result.exit_code != 0 and "variants" in result.output
