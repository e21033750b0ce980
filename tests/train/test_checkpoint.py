"""Checkpoints: exact resume in process, atomic layout, pruning, corrupt or mismatched files, run directories."""

import pytest
import torch
from safetensors.torch import load_file

from titans.train import Trainer, load_train_config, train
from titans.train.checkpoint import (
    RUN_MARKER,
    latest_checkpoint,
    list_checkpoints,
    load_trainer_state,
    load_weights,
    prepare_run_dir,
)


def weights(run_dir):
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bfloat16: autocast over float32 master weights
def test_resume_gives_identical_weights_and_keeps_the_newest_checkpoints(tiny_config, tmp_path, dtype):
    cfg = load_train_config(tiny_config, ["steps=12", "checkpoint_every=3", "model.dropout=0.1",  # dropout: RNG
                                          f"dtype={dtype}"])
    train(cfg, tmp_path / "straight", quiet=True)
    assert [p.name for p in list_checkpoints(tmp_path / "straight")] == ["step_0000009", "step_0000012"]

    interrupted = Trainer(cfg, tmp_path / "split", quiet=True)  # the first 5 steps of the same run, then stop
    for _ in range(5):
        interrupted.train_step()
        interrupted.step += 1
    interrupted.save()
    resumed = Trainer(cfg, tmp_path / "split", quiet=True)
    assert resumed.resume() and resumed.step == 5
    resumed.run()
    straight, split = weights(tmp_path / "straight"), weights(tmp_path / "split")
    assert all(torch.equal(straight[k], split[k]) for k in straight)
    different = load_train_config(tiny_config, ["steps=12", "checkpoint_every=3", "model.dropout=0.1", "seed=1",
                                                f"dtype={dtype}"])
    train(different, tmp_path / "other_seed", quiet=True)  # the comparison can fail
    assert not all(torch.equal(straight[k], v) for k, v in weights(tmp_path / "other_seed").items())


def test_a_metrics_line_cut_off_by_a_kill_does_not_block_resume(tiny_config, tmp_path):
    import json

    train(load_train_config(tiny_config, ["steps=4", "checkpoint_every=2"]), tmp_path / "run", quiet=True)
    log = tmp_path / "run" / "metrics.jsonl"
    log.write_text(log.read_text() + '{"step": 5, "loss": 0.')  # a kill came mid-write
    longer = load_train_config(tiny_config, ["steps=6", "checkpoint_every=2"])
    resumed = Trainer(longer, tmp_path / "run", quiet=True)
    assert resumed.resume() and resumed.step == 4
    resumed.run()
    records = [json.loads(line) for line in log.read_text().splitlines()]  # every line whole again
    assert records[-1].get("final") and sum(bool(r.get("final")) for r in records) == 1
    assert not (tmp_path / "run" / "metrics.jsonl.tmp").exists()
    log.write_text('{"step": 1}\nnot json\n{"step": 2}\n')  # damage elsewhere is an error, not dropped silently
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        Trainer(longer, tmp_path / "run", quiet=True).resume()


def test_a_write_killed_half_way_is_ignored_and_cleaned_up(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["steps=4"])
    train(cfg, tmp_path / "run", quiet=True)
    half_written = tmp_path / "run" / "checkpoints" / ".tmp_step_0000006_123"
    half_written.mkdir()
    (half_written / "model.safetensors").write_bytes(b"\0" * 10)
    assert latest_checkpoint(tmp_path / "run").name == "step_0000004"
    trainer = Trainer(cfg.replace(steps=6), tmp_path / "run", quiet=True)
    assert trainer.resume() and trainer.step == 4
    trainer.run()
    assert not half_written.exists()
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000004", "step_0000006"]


def test_resume_without_a_checkpoint_starts_over(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["steps=2"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 7, "loss": 1.0}\n')
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    assert not trainer.resume() and trainer.step == 0
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == ""


def test_resume_refuses_another_model(tiny_config, tmp_path):
    train(load_train_config(tiny_config, ["steps=2"]), tmp_path / "run", quiet=True)
    trainer = Trainer(load_train_config(tiny_config, ["steps=4", "model.heads=4"]), tmp_path / "run")
    with pytest.raises(ValueError, match=r"model\.heads \(2 -> 4\)"):
        trainer.resume()


def test_corrupt_or_mismatched_files_raise_value_errors(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["steps=2"])
    train(cfg, tmp_path / "run", quiet=True)
    path = latest_checkpoint(tmp_path / "run")
    other = Trainer(load_train_config(tiny_config, ["model.dim=32"]), tmp_path / "other").model
    with pytest.raises(ValueError, match="does not match"):
        load_weights(path, other)
    (path / "trainer.pt").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="unreadable trainer.pt"):
        load_trainer_state(path)
    torch.save({"step": 2}, path / "trainer.pt")
    with pytest.raises(ValueError, match="lacks the trainer state"):
        load_trainer_state(path)
    (path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(ValueError, match="corrupt"):
        load_weights(path, Trainer(cfg, tmp_path / "again").model)


def test_run_directories_are_never_overwritten_by_accident(tmp_path):
    run = tmp_path / "run"
    prepare_run_dir(run)
    assert (run / RUN_MARKER).is_file()
    (run / "metrics.jsonl").write_text("kept")
    with pytest.raises(ValueError, match="already exists"):
        prepare_run_dir(run)
    prepare_run_dir(run, resume=True)
    assert (run / "metrics.jsonl").read_text() == "kept"
    prepare_run_dir(run, force=True)
    assert not (run / "metrics.jsonl").exists() and (run / RUN_MARKER).is_file()

    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(ValueError, match="not made by titans"):
        prepare_run_dir(foreign, force=True)
    with pytest.raises(ValueError, match="not a titans run directory"):
        prepare_run_dir(foreign, resume=True)
    assert (foreign / "thesis.tex").read_text() == "precious"
    prepare_run_dir(tmp_path / "empty")  # a new directory
    assert (tmp_path / "empty" / RUN_MARKER).is_file()
