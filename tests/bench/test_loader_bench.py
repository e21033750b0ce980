"""`titans bench loader`: it draws the trainer's batches from shards and writes what it measured (no timing asserted:
a benchmark is a command, not a test)."""

import json
import sys

import pytest
from typer.testing import CliRunner

from titans.cli import app, main
from titans.tasks import get_task
from titans.train.batches import TRAIN_STREAM, sample_rows

pytest.importorskip("tokenizers", reason="the data extra (tokenizers) is not installed")
runner = CliRunner()


def test_loader_bench_writes_its_points(token_shards, tmp_path):
    out = tmp_path / "loader.json"
    result = runner.invoke(app, ["bench", "loader", str(token_shards["dir"]), "--lengths", "16,64", "--batch", "4",
                                 "--seconds", "0.1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert record["command"].startswith("titans bench loader") and record["machine"]
    assert [p["length"] for p in record["points"]] == [16, 64]
    for p in record["points"]:
        assert p["batches"] >= 1 and p["pinned"] is False  # no GPU here: no pinned allocator
        assert p["tokens_per_s"] == pytest.approx(p["batches"] * 4 * p["length"] / p["seconds"])



def test_a_missing_shard_directory_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["titans", "bench", "loader", str(tmp_path / "none"), "--seconds", "0.1"])
    with pytest.raises(SystemExit) as exit_info:
        main()
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1 and "does not exist" in err, err


def test_seeded_rows_do_not_depend_on_the_batch_they_are_in(token_shards):
    task = get_task("lm_tokens", data=str(token_shards["dir"]))
    whole = sample_rows(task, range(6), 32, TRAIN_STREAM, 1, 2)
    parts = [sample_rows(task, range(i, i + 1), 32, TRAIN_STREAM, 1, 2) for i in range(6)]
    assert all((whole.inputs[i] == p.inputs[0]).all() for i, p in enumerate(parts))
    assert len({tuple(row.tolist()) for row in whole.inputs}) == 6  # six different windows
