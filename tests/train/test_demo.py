"""`titans demo` end to end with tiny configs: runs side by side, table, PNG, JSON whose path is the last line."""

import json

import torch
import yaml
from typer.testing import CliRunner

from titans.cli import app
from titans.train.demo import format_table


def tiny_demo_config(tmp_path, tiny_config, name, variant):
    data = yaml.safe_load(tiny_config.read_text())
    data.update(name=name, steps=3, checkpoint_every=0)
    data["model"].update(variant=variant, window=8)
    data["task"]["eval_lengths"] = [24, 48, 96, 192]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_demo_writes_table_plot_and_json(tmp_path, tiny_config):
    configs = [tiny_demo_config(tmp_path, tiny_config, "titans-lmm", "lmm"),
               tiny_demo_config(tmp_path, tiny_config, "swa-baseline", "swa")]
    out = tmp_path / "demo"
    args = ["demo", "--out", str(out), "--jobs", "2"] + [a for c in configs for a in ("--configs", str(c))]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert lines[-1] == str(out / "demo.json")
    data = json.loads((out / "demo.json").read_text())
    assert data["task"] == "passkey" and data["train_length"] == 24
    assert list(data["results"]) == ["titans-lmm", "swa-baseline"]
    for name in data["results"]:
        assert list(data["results"][name]) == ["24", "48", "96", "192"]
        assert all(0.0 <= acc <= 1.0 for acc in data["results"][name].values())
        # the run directories hold what the demo reports
        assert json.loads((out / name / "eval.json").read_text())["results"]["96"]["accuracy"] == \
            data["results"][name]["96"]
        assert data["runs"][name]["steps"] == 3
    assert (out / "demo.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and (out / "demo.png").stat().st_size > 5000
    assert format_table(data["results"]) in result.stdout
    assert data["wall_seconds"] > 0 and "s of training and evaluation (wall clock" in result.stdout  # time printed

    again = CliRunner().invoke(app, args)  # the output directory is not overwritten without --force
    assert again.exit_code == 2 and "already exists" in again.stderr
    assert "--force" in again.stderr and "--resume" not in again.stderr  # demo has no --resume to suggest
    assert json.loads((out / "demo.json").read_text()) == data

    def refused(extra_args, message):
        result = CliRunner().invoke(app, ["demo", "--out", str(out), "--force", "--jobs", "1", *extra_args])
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert json.loads((out / "demo.json").read_text()) == data  # checked before anything was deleted

    refused(["--configs", str(tmp_path / "missing.yaml")], "does not exist")
    series = [tiny_demo_config(tmp_path, tiny_config, f"series-{v}", v) for v in ("lmm", "swa")]
    for path in series:
        cfg = yaml.safe_load(path.read_text())
        cfg["task"] = {"name": "forecast_sine", "train_length": 24, "eval_lengths": [24]}
        path.write_text(yaml.safe_dump(cfg))
    refused([a for c in series for a in ("--configs", str(c))], "series task forecast_sine")
    if not torch.cuda.is_available():  # what only a run's trainer checks is checked before the old output goes
        on_gpu = [tiny_demo_config(tmp_path, tiny_config, f"gpu-{v}", v) for v in ("lmm", "swa")]
        for path in on_gpu:
            path.write_text(path.read_text() + "device: cuda\n")
        refused([a for c in on_gpu for a in ("--configs", str(c))], "cuda")
    fresh = tmp_path / "never"
    result = CliRunner().invoke(app, ["demo", "--out", str(fresh), "--configs", str(tmp_path / "missing.yaml")])
    assert result.exit_code == 2 and not fresh.exists()  # a refused demo leaves no folder to refuse later


def test_table_has_a_row_per_model_and_a_column_per_length():
    table = format_table({"a": {"256": 1.0, "512": 0.5}, "swa": {"256": 0.75, "512": 0.125}})
    assert table.splitlines() == ["| model | 256 | 512 |", "|---|---:|---:|", "| a | 1.000 | 0.500 |",
                                  "| swa | 0.750 | 0.125 |"]
