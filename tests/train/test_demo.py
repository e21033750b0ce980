"""`titans demo` end to end with tiny configs: table, PNG, JSON whose path is the last line."""

import json

import yaml
from typer.testing import CliRunner

from titans.cli import app


def tiny(tmp_path, name, variant):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name,
        "model": {"variant": variant, "dim": 16, "depth": 1, "heads": 2, "window": 8, "chunk_size": 4},
        "task": {"name": "passkey", "options": {"vocab": 16, "num_values": 8}, "train_length": 24,
                 "eval_lengths": [24, 48, 96, 192]},
        "steps": 3, "batch_size": 4, "eval_batches": 1, "checkpoint_every": 0,
    }))
    return path


def test_demo_writes_table_plot_and_json(tmp_path):
    configs = [tiny(tmp_path, "titans-lmm", "lmm"), tiny(tmp_path, "swa-baseline", "swa")]
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--quiet"] + [a for c in configs for a in ("--configs", str(c))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    last = result.output.strip().splitlines()[-1]
    assert last == str(out / "demo.json")
    data = json.loads((out / "demo.json").read_text())
    assert data["task"] == "passkey" and data["train_length"] == 24
    assert set(data["results"]) == {"titans-lmm", "swa-baseline"}
    assert any("swa" in name for name in data["results"])
    assert set(data["results"]["titans-lmm"]) == {"24", "48", "96", "192"}
    assert all(0.0 <= acc <= 1.0 for accs in data["results"].values() for acc in accs.values())
    assert (out / "demo.png").stat().st_size > 1000
    assert "| titans-lmm |" in result.output
    again = CliRunner().invoke(app, args)  # the output directory is not overwritten without --force
    assert again.exit_code == 2 and "already exists" in again.output
