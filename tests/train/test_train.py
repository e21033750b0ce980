"""Trainer: schedule, determinism, exact resume after SIGKILL, DDP == one process, configs, CLI errors."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file
from typer.testing import CliRunner

from titans.cli import app
from titans.train import OptimConfig, load_train_config, lr_at, train
from titans.train.checkpoint import latest_checkpoint

ROOT = Path(__file__).resolve().parents[2]
TINY = {
    "model": {"variant": "lmm", "dim": 16, "depth": 1, "heads": 2, "chunk_size": 4},
    "task": {"name": "passkey", "options": {"vocab": 24, "num_values": 8}, "train_length": 24,
             "eval_lengths": [24, 48]},
    "optim": {"lr": 0.01, "warmup_steps": 2},
    "steps": 6,
    "batch_size": 4,
    "eval_batches": 1,
    "checkpoint_every": 2,
    "log_every": 1,
}


def write_tiny(tmp_path: Path, **changes) -> Path:
    data = json.loads(json.dumps(TINY))
    data.update(changes)
    path = tmp_path / "tiny.yaml"
    import yaml

    path.write_text(yaml.safe_dump(data))
    return path


def weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def test_schedule_warmup_then_cosine():
    optim = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, optim, 110) == pytest.approx(0.1)
    assert lr_at(9, optim, 110) == pytest.approx(1.0)
    assert lr_at(60, optim, 110) == pytest.approx(0.55)
    assert lr_at(110, optim, 110) == pytest.approx(0.1)


def test_vocab_size_comes_from_the_task(tmp_path):
    cfg = load_train_config(write_tiny(tmp_path))
    assert cfg.model.vocab_size == 24
    cfg = load_train_config(write_tiny(tmp_path), ["model.vocab_size=40", "steps=3"])
    assert cfg.model.vocab_size == 40 and cfg.steps == 3


def test_training_is_deterministic_and_learns(tmp_path):
    cfg = load_train_config(write_tiny(tmp_path), ["steps=30", "checkpoint_every=0"])
    a = train(cfg, tmp_path / "a", quiet=True)
    train(cfg, tmp_path / "b", quiet=True)
    assert all(torch.equal(weights(tmp_path / "a")[k], v) for k, v in weights(tmp_path / "b").items())
    losses = [json.loads(line)["loss"] for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line and '"eval"' not in line]
    assert losses[-1] < losses[0]
    assert a.evaluation.keys() == {24, 48}
    assert json.loads((tmp_path / "a" / "eval.json").read_text())["results"]["24"]["accuracy"] >= 0


def test_resume_after_sigkill_gives_identical_weights(tmp_path):
    config = write_tiny(tmp_path, steps=40, checkpoint_every=4)
    cli = [sys.executable, "-m", "titans.cli", "train", str(config), "--quiet"]
    straight_run = subprocess.run(cli + ["--out", str(tmp_path / "straight")], capture_output=True, text=True,
                                  timeout=300)
    assert straight_run.returncode == 0, straight_run.stderr[-2000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(cli + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline:  # kill once a checkpoint past the first exists, mid-run
        latest = latest_checkpoint(killed)
        if latest is not None and int(latest.name.split("_")[1]) >= 8:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    step_at_kill = int(latest_checkpoint(killed).name.split("_")[1])
    assert step_at_kill < 40, "the run finished before it could be killed"
    out = subprocess.run(cli + ["--out", str(killed), "--resume"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    straight, resumed = weights(tmp_path / "straight"), weights(killed)
    assert straight.keys() == resumed.keys()
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()
             if '"eval"' not in line]
    assert steps == sorted(set(steps)) and steps[-1] == 40  # no duplicated lines after the resume


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, config: str, run_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cfg = load_train_config(config, ["steps=5", "checkpoint_every=0"])
    result = train(cfg, Path(run_dir), quiet=True)
    queue.put((rank, result.final_loss))  # rank 0 wrote the weights to run_dir
    torch.distributed.destroy_process_group()


def test_two_ranks_match_one_rank_on_the_same_global_batch(tmp_path):
    config = str(write_tiny(tmp_path, batch_size=8))
    single = train(load_train_config(config, ["steps=5", "checkpoint_every=0"]), tmp_path / "single", quiet=True)
    single_weights = weights(tmp_path / "single")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_ddp_worker, args=(r, 2, port, config, str(tmp_path / "ddp"), queue)) for r in (0, 1)]
    for p in procs:
        p.start()
    losses = dict(queue.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert losses[0] == pytest.approx(losses[1], abs=1e-12)  # ranks agree
    assert losses[0] == pytest.approx(single.final_loss, rel=1e-5)
    ddp_weights = weights(tmp_path / "ddp")
    assert max((ddp_weights[k] - single_weights[k]).abs().max().item() for k in single_weights) < 1e-5


def test_every_shipped_config_loads_and_builds():
    from titans.train import build_model, build_task

    paths = sorted((ROOT / "configs").rglob("*.yaml"))
    assert len(paths) >= 10
    for path in paths:
        cfg = load_train_config(path)
        task = build_task(cfg)
        model = build_model(cfg, task)
        assert sum(p.numel() for p in model.parameters()) > 0, path


runner = CliRunner()


def one_line_error(result) -> str:
    assert result.exit_code != 0
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    return lines[0]


def test_cli_bad_inputs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories land here
    assert "does not exist" in one_line_error(runner.invoke(app, ["train", str(tmp_path / "none.yaml")]))
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model: [unclosed")
    assert "not valid YAML" in one_line_error(runner.invoke(app, ["train", str(bad_yaml)]))
    assert "unknown task" in one_line_error(runner.invoke(app, ["train", str(write_tiny(tmp_path)), "task.name=chess"]))
    assert "model.dimm" in one_line_error(runner.invoke(app, ["train", str(write_tiny(tmp_path)), "model.dimm=3"]))
    csv = tmp_path / "text.csv"
    csv.write_text("date,name\n2020-01-01,a\n2020-01-02,b\n")
    config = write_tiny(tmp_path)
    msg = one_line_error(runner.invoke(app, ["train", str(config), "task.name=forecast_csv",
                                             f"task.options={{path: {csv}}}", "model.vocab_size=1"]))
    assert "no numeric columns" in msg
    assert not (tmp_path / "runs").exists()  # nothing was written for a bad config
    assert "neither a checkpoint" in one_line_error(runner.invoke(app, ["eval", str(tmp_path)]))


def test_cli_train_eval_generate_and_no_overwrite(tmp_path):
    config = write_tiny(tmp_path)
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(config), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().splitlines()[-1].endswith("eval.json")
    before = (out / "metrics.jsonl").read_text()
    assert "already exists" in one_line_error(runner.invoke(app, ["train", str(config), "--out", str(out)]))
    assert (out / "metrics.jsonl").read_text() == before  # nothing was touched
    result = runner.invoke(app, ["eval", str(out), "--lengths", "24,40", "--batches", "1",
                                 "--out", str(tmp_path / "e.json")])
    assert result.exit_code == 0, result.output
    assert set(json.loads((tmp_path / "e.json").read_text())["results"]) == {"24", "40"}
    result = runner.invoke(app, ["generate", str(out), "--prompt", "3 4 5", "--max-new-tokens", "4"])
    assert result.exit_code == 0 and len(result.output.split()) == 4
    msg = one_line_error(runner.invoke(app, ["generate", str(out), "--prompt", "1 2 3", "--max-prompt-tokens", "2"]))
    assert "longer" in msg or "more than" in msg
    corrupt = out / "checkpoints" / latest_checkpoint(out).name / "model.safetensors"
    corrupt.write_bytes(b"not a safetensors file")
    assert "corrupt" in one_line_error(runner.invoke(app, ["eval", str(out)]))
    result = runner.invoke(app, ["train", str(config), "--out", str(out), "--force", "--quiet"])
    assert result.exit_code == 0, result.output
