"""`titans bench recall` at toy sizes: runs, table, JSON, and finished runs reused on a second invocation."""

import json

from typer.testing import CliRunner

from titans.bench.recall import MULTIPLES, format_table
from titans.cli import app


def test_bench_recall_end_to_end_and_resumes(tmp_path):
    out, runs = tmp_path / "recall.json", tmp_path / "runs"
    args = ["bench", "recall", "--variants", "lmm,swa", "--tasks", "passkey,kv_recall", "--steps", "2",
            "--train-length", "16", "--workers", "1", "--run-dir", str(runs), "--out", str(out),
            # small models and batches: the command is under test here, not what the defaults learn
            "--set", "model.dim=16", "--set", "batch_size=4", "--set", "eval_batches=1", "--set", "eval_batch_size=4"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [(r["variant"], r["task"]) for r in data["runs"]] == [("lmm", "passkey"), ("swa", "passkey"),
                                                                 ("lmm", "kv_recall"), ("swa", "kv_recall")]
    assert all(set(r["accuracy"]) == {"1x", "4x", "8x"} and r["steps"] == 2 for r in data["runs"])
    assert "| lmm |" in result.output and "| swa |" in result.output
    stamps = {p: p.stat().st_mtime_ns for p in runs.glob("*/eval.json")}
    assert len(stamps) == 4
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 0, again.output
    assert {p: p.stat().st_mtime_ns for p in runs.glob("*/eval.json")} == stamps  # nothing retrained
    changed = CliRunner().invoke(app, [*args[:7], "3", *args[8:]])  # --steps 3: a different config, trained anew
    assert changed.exit_code == 0, changed.output
    assert all(p.stat().st_mtime_ns != stamps[p] for p in stamps)


def test_overrides_change_the_measured_defaults(tmp_path):
    from titans.bench.recall import recall_config

    cfg = recall_config("lmm", "kv_recall", 0, 5, 16, ["model.memory_init_eta=0.5", "model.memory.max_lr=0.02"])
    assert (cfg.model.memory.init_eta, cfg.model.memory.max_lr, cfg.model.dim) == (0.5, 0.02, 64)
    default = recall_config("lmm", "kv_recall", 0, 5, 16)
    assert default.model.memory.init_eta == 0.1 and default.model.memory.max_lr == 1.0


def test_table_averages_seeds():
    rows = [{"variant": "lmm", "task": "mqar", "accuracy": {f"{m}x": a for m in MULTIPLES}} for a in (0.5, 1.0)]
    assert format_table(rows, ["mqar"]).splitlines()[-1] == "| lmm | 0.75 | 0.75 | 0.75 |"
