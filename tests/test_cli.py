"""The command line: SIGKILL + resume end to end, train/eval/generate/export, one-line errors, no overwriting."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from typer.testing import CliRunner

from titans import TitansLM
from titans.cli import app, main
from titans.tasks.lm import file_split as lm_split
from titans.train.checkpoint import checkpoint_step, latest_checkpoint, load_checkpoint_config, load_weights

TINY = Path(__file__).parent / "train" / "tiny.yaml"
runner = CliRunner()
pytestmark = pytest.mark.usefixtures("one_thread")


def weights(run_dir: Path) -> dict:
    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_killed_run_resumes_to_identical_weights(tmp_path):
    cli = [sys.executable, "-m", "titans.cli", "train", str(TINY), "steps=150", "checkpoint_every=4", "--quiet"]
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cli + ["--out", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600  # generous: a loaded machine (or a first build of the C++ kernels) is slow to start
    while time.time() < deadline and proc.poll() is None:  # kill it mid-run, after its second checkpoint
        latest = latest_checkpoint(killed)
        if latest is not None and checkpoint_step(latest) >= 8:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()[-2000:]
    assert latest_checkpoint(killed) is not None, "no checkpoint within the deadline"
    step_at_kill = checkpoint_step(latest_checkpoint(killed))
    assert 8 <= step_at_kill < 150
    assert not (killed / "eval.json").exists()

    resumed = subprocess.run(cli + ["--out", str(killed), "--resume"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert resumed.stdout.splitlines()[-1] == str(killed / "eval.json")
    straight = subprocess.run(cli + ["--out", str(tmp_path / "straight")], capture_output=True, text=True,
                              timeout=300)
    assert straight.returncode == 0, straight.stderr[-2000:]

    one, two = weights(tmp_path / "straight"), weights(killed)
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)
    def reproducible(run_dir):  # every logged number but the timings
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "train_seconds")} for r in records]

    assert [r["step"] for r in reproducible(killed) if "loss" in r] == list(range(1, 151))  # none lost or twice
    assert reproducible(killed) == reproducible(tmp_path / "straight")


def test_train_eval_generate_and_never_overwrite(tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "train.steps=4"])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == str(out / "eval.json")
    assert "skipped steps (non-finite loss or gradient): 0 of 4" in result.stdout
    assert yaml.safe_load((out / "config.yaml").read_text())["steps"] == 4

    before = (out / "metrics.jsonl").read_text()
    refused = one_line_error(runner.invoke(app, ["train", str(TINY), "--out", str(out)]))
    assert "already exists" in refused and "--force" in refused and "--resume" in refused
    assert (out / "metrics.jsonl").read_text() == before

    result = runner.invoke(app, ["eval", str(out), "--lengths", "24,40", "--batches", "2"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["length", "loss", "accuracy", "token_accuracy"]
    assert [line.split()[0] for line in lines[1:3]] == ["24", "40"]
    saved = json.loads(Path(lines[-1]).read_text())
    assert saved["task"] == "passkey" and set(saved["results"]) == {"24", "40"}
    assert float(lines[1].split()[2]) == pytest.approx(saved["results"]["24"]["accuracy"], abs=1e-4)
    assert saved["split"] is None and saved["skipped_steps"] == 0
    assert lines[-2] == "skipped steps in training (non-finite loss or gradient): 0"
    bare = tmp_path / "bare"  # weights and config only, as someone might copy a checkpoint
    bare.mkdir()
    for name in ("model.safetensors", "config.yaml"):
        (bare / name).write_bytes((Path(saved["checkpoint"]) / name).read_bytes())
    result = runner.invoke(app, ["eval", str(bare), "--lengths", "24", "--batches", "1"])
    assert result.exit_code == 0, result.output
    assert "skipped steps in training (non-finite loss or gradient): unknown" in result.stdout
    assert json.loads((bare / "eval_passkey.json").read_text())["skipped_steps"] is None
    assert "has no splits" in one_line_error(runner.invoke(app, ["eval", str(out), "--split", "test"]))

    result = runner.invoke(app, ["generate", str(out), "--prompt", "3 4 5", "--max-new-tokens", "5",
                                 "--temperature", "0"])
    assert result.exit_code == 0, result.output
    tokens = [int(t) for t in result.stdout.split()]
    assert len(tokens) == 5 and all(0 <= t < 24 for t in tokens)

    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--force", "--quiet", "steps=2"])
    assert result.exit_code == 0, result.output
    assert checkpoint_step(latest_checkpoint(out)) == 2


def test_generate_reads_token_ids_for_a_token_task_even_with_256_ids(tmp_path):
    """Whether a prompt is text is the task's property, not the vocabulary size's."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "steps=1",
                                 "task.options={vocab: 256, num_values: 8}", "model.vocab_size=256"])
    assert result.exit_code == 0, result.output
    result = runner.invoke(app, ["generate", str(out), "--prompt", "3 4 5", "--max-new-tokens", "4",
                                 "--temperature", "0"])
    assert result.exit_code == 0, result.output
    assert len([int(t) for t in result.stdout.split()]) == 4
    assert "token ids" in one_line_error(runner.invoke(app, ["generate", str(out), "--prompt", "hello"]))
    static = runner.invoke(app, ["generate", str(out), "--prompt", "3 4 5", "--max-new-tokens", "4",
                                 "--temperature", "0", "--decode", "static"])
    assert static.exit_code == 0 and static.stdout == result.stdout, static.output  # the static step: the same tokens
    refused = one_line_error(runner.invoke(app, ["generate", str(out), "--prompt", "3 4 5", "--decode", "graph"]))
    assert "decode='graph' captures CUDA graphs" in refused


def test_eval_of_a_data_task_defaults_to_validation_and_takes_a_split(tmp_path):
    rows = "".join(f"{i},{i % 7},{(i * 3) % 5 + (i >= 800) * 50}\n" for i in range(1000))  # the test rows shift
    (tmp_path / "s.csv").write_text("date,a,b\n" + rows)
    out = tmp_path / "run"
    csv_task = f"task.options={{path: {tmp_path / 's.csv'}}}"
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "steps=2", "model.variant=mag",
                                 "model.window=8", "task.name=forecast_csv", csv_task])
    assert result.exit_code == 0, result.output
    trained = json.loads((out / "eval.json").read_text())["results"]["24"]["loss"]
    losses = {}
    for split in (None, "val", "test"):
        argv = ["eval", str(out), "--lengths", "24", "--out", str(tmp_path / f"{split}.json")]
        result = runner.invoke(app, argv + (["--split", split] if split else []))
        assert result.exit_code == 0, result.output
        saved = json.loads((tmp_path / f"{split}.json").read_text())
        assert saved["split"] == (split or "val")
        losses[split] = saved["results"]["24"]["loss"]
    assert losses[None] == losses["val"] == pytest.approx(trained)  # what training reported: the validation split
    assert losses["test"] > 10 * losses["val"]  # test rows lie 50 above anything seen in training
    assert "split" in one_line_error(runner.invoke(app, ["eval", str(out), "--split", "holdout"]))
    error = one_line_error(runner.invoke(app, ["eval", str(out), "--task", "forecast_sine"]))
    assert "forecast_sine has 4 features per step but the checkpoint was trained on 2" in error


def test_eval_of_a_classifier_defaults_to_the_test_split(tmp_path):
    """A UCR set (the toy one in tests/data/ucr) has TRAIN and TEST only: eval reads TEST whole, as training
    reported it, or TRAIN when asked; a task without classes is refused."""
    out, root = tmp_path / "run", Path(__file__).parent / "data" / "ucr"
    task = f"task={{name: ucr, options: {{dataset: Toy, root: {root}}}, train_length: 12, eval_lengths: [12]}}"
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "steps=2", "model.variant=lstm",
                                 task])
    assert result.exit_code == 0, result.output
    trained = json.loads((out / "eval.json").read_text())["results"]["12"]
    found = {}
    for split in (None, "train"):
        result = runner.invoke(app, ["eval", str(out), "--out", str(tmp_path / f"{split}.json")]
                               + (["--split", split] if split else []))
        assert result.exit_code == 0, result.output
        saved = json.loads((tmp_path / f"{split}.json").read_text())
        found[saved["split"]] = saved["results"]["12"]
    assert found["test"] == pytest.approx(trained) and found["test"]["examples"] == 6
    assert found["train"]["examples"] == 8
    error = one_line_error(runner.invoke(app, ["eval", str(out), "--task", "forecast_sine", "--lengths", "12"]))
    assert "forecast_sine has no classes but the checkpoint was trained on 2" in error


@pytest.mark.parametrize("argv, message", [
    (["train"], "Missing argument"),
    (["train", str(TINY), "--bogus"], "No such option: --bogus"),
    (["eval", "x", "--batches", "zero"], "--batches"),
    (["nonsense"], "No such command"),
])
def test_usage_errors_are_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["titans", *argv])
    with pytest.raises(SystemExit) as exit_info:
        main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # default run directories would land here
    assert "does not exist" in one_line_error(runner.invoke(app, ["train", "none.yaml"]))
    (tmp_path / "bad.yaml").write_text("model: [unclosed")
    assert "not valid YAML" in one_line_error(runner.invoke(app, ["train", "bad.yaml"]))
    assert "unknown task 'chess'" in one_line_error(runner.invoke(app, ["train", str(TINY), "task.name=chess"]))
    assert "model.dimm" in one_line_error(runner.invoke(app, ["train", str(TINY), "model.dimm=3"]))
    assert "key.path=value" in one_line_error(runner.invoke(app, ["train", str(TINY), "steps"]))
    (tmp_path / "text.csv").write_text("date,name\n2020-01-01,a\n2020-01-02,b\n")
    csv_task = ["task.name=forecast_csv", "task.options={path: text.csv}"]
    assert "no numeric columns" in one_line_error(runner.invoke(app, ["train", str(TINY), *csv_task]))
    (tmp_path / "short.csv").write_text("date,a\n" + "".join(f"{i},{i % 3}\n" for i in range(100)))
    too_long = ["task.name=forecast_csv", "task.options={path: short.csv}", "model.variant=mag", "model.window=8",
                "task.eval_lengths=[24,48]", "--out", "short-run"]  # the validation split has 10 rows
    assert "too long for the val split" in one_line_error(runner.invoke(app, ["train", str(TINY), *too_long]))
    assert not (tmp_path / "short-run").exists()  # a run that never started leaves no folder to refuse later
    fits = [*too_long[:-3], "task.eval_lengths=[8]", "task.train_length=8", "steps=1"]
    assert runner.invoke(app, ["train", str(TINY), *fits, "--out", "short-run", "--quiet"]).exit_code == 0
    before = sorted(p.relative_to(tmp_path) for p in (tmp_path / "short-run").rglob("*"))
    error = one_line_error(runner.invoke(app, ["train", str(TINY), *too_long, "--force"]))
    assert "too long for the val split" in error  # --force replaces a run only once the new one is checked
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "short-run").rglob("*")) == before
    assert "not a titans run directory" in one_line_error(runner.invoke(app, ["train", str(TINY), "--resume"]))
    huge = ["model.vocab_size=16777216", "model.dim=16777216", "--out", "huge"]  # 1 PiB: beyond any address space
    assert "out of memory" in one_line_error(runner.invoke(app, ["train", str(TINY), *huge]))
    assert not (tmp_path / "huge").exists()
    assert "neither a checkpoint" in one_line_error(runner.invoke(app, ["eval", str(tmp_path)]))
    assert "does not exist" in one_line_error(runner.invoke(app, ["generate", "missing", "--prompt", "1"]))
    assert not (tmp_path / "runs").exists()


def test_a_config_refused_for_several_fields_names_each_on_its_own_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["train", str(TINY), "model.dim=-1", "optim.lr=.nan", "stepz=3"])
    assert result.exit_code == 2, result.output
    assert result.stderr.splitlines() == [
        "error: model.dim: must be >= 1, got -1",
        "error: optim.lr: expected a finite number, got nan",
        "error: stepz: unknown field for TrainConfig; valid fields: activation_checkpointing, batch_size, "
        "carry_windows, checkpoint_every, compile, device, dtype, eval_batch_size, eval_batches, eval_every, "
        "eval_piece, eval_position_buckets, keep_checkpoints, log_every, max_skips_in_row, model, name, optim, "
        "parallel, seed, steps, task, tensorboard, threads, time_budget_s",
    ]
    assert not (tmp_path / "runs").exists()


def test_evaluations_are_kept_apart_and_survive_pruning(tmp_path, monkeypatch):
    """eval's default file sits in the run directory and is named by task, split, seed and step; resuming (which
    prunes old checkpoints) leaves it, and a file put into a pruned checkpoint folder stays too."""
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "steps=2"]).exit_code == 0
    written = []
    for extra in ([], ["--seed", "3"], ["--lengths", "24"]):
        result = runner.invoke(app, ["eval", str(out), "--batches", "1", *extra])
        assert result.exit_code == 0, result.output
        written.append(Path(result.stdout.splitlines()[-1]))
    assert [p.name for p in written] == ["eval_passkey_step2.json", "eval_passkey_seed3_step2.json",
                                         "eval_passkey_step2.json"]  # the same evaluation, asked again
    mine = latest_checkpoint(out) / "notes.txt"
    mine.write_text("mine")
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--resume", "--quiet", "steps=6",
                                 "checkpoint_every=1"])
    assert result.exit_code == 0, result.output
    assert all(p.is_file() for p in written) and mine.read_text() == "mine"
    assert checkpoint_step(latest_checkpoint(out)) == 6 and latest_checkpoint(out) != mine.parent

    step = latest_checkpoint(out)
    monkeypatch.chdir(step)  # however the checkpoint is written, the default file is the run directory's
    result = runner.invoke(app, ["eval", ".", "--batches", "1"])
    assert result.exit_code == 0 and result.stdout.splitlines()[-1] == str(out / "eval_passkey_step6.json")
    best = out / "checkpoints" / "best"  # a checkpoint folder the user named: its results go into it
    shutil.copytree(step, best)
    result = runner.invoke(app, ["eval", str(best), "--batches", "1"])
    assert result.exit_code == 0 and result.stdout.splitlines()[-1] == str(best / "eval_passkey.json")


def test_train_prints_metrics_by_position_the_largest_gradient_and_the_bound_share(tmp_path):
    """An lm-style run evaluates by position (lists in eval.json): the summary prints them, it does not crash after
    training, and it names the largest gradient norm before clipping and the share of θ_t the momentum-gain bound
    lowered."""
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "train.steps=2",
                                 "eval_position_buckets=2"])
    assert result.exit_code == 0, result.output
    saved = json.loads((out / "eval.json").read_text())
    by_position = next(iter(saved["results"].values()))["loss_by_position"]
    assert len(by_position) == 2
    assert "loss_by_position [" in result.stdout
    assert f"largest gradient norm before clipping: {saved['peak_grad_norm']:.4g} at step " \
           f"{saved['peak_grad_step']}" in result.stdout
    assert "learned θ_t lowered by the momentum-gain bound (κ = 1): " in result.stdout
    assert f"({saved['momentum_bound_share']:.3%})" in result.stdout


def test_force_keeps_the_old_run_when_the_training_split_cannot_serve(tmp_path):
    """lm_bytes splits files by a hash of their path: a pattern matching one validation file leaves the training
    split empty, which --force must find before it deletes the old run."""
    for i in range(40):
        (tmp_path / f"f{i}.txt").write_text("some text to model, " * 40)
    val_file = next(f"f{i}.txt" for i in range(40) if lm_split(f"f{i}.txt", 0.5) == "val")
    lm = ["task.name=lm_bytes", f"task.options={{root: {tmp_path}, pattern: '*.txt', val_fraction: 0.5}}",
          "model.vocab_size=256", "task.train_length=24", "task.eval_lengths=[24]", "steps=1", "--quiet"]
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", str(TINY), *lm, "--out", str(out)]).exit_code == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    one_file = [*lm[:1], f"task.options={{root: {tmp_path}, pattern: {val_file}, val_fraction: 0.5}}", *lm[2:]]
    assert "train split" in one_line_error(runner.invoke(app, ["train", str(TINY), *one_file, "--out", str(out),
                                                               "--force"]))
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    # A prompt argument that is not UTF-8 reaches Python with surrogates: a byte-level model takes its bytes.
    result = runner.invoke(app, ["generate", str(out), "--prompt", "ab\udcff", "--max-new-tokens", "3",
                                 "--temperature", "0"])
    assert result.exit_code == 0, result.output


def test_resume_checks_the_config_before_the_first_checkpoint_and_the_metrics_log(tmp_path):
    out = tmp_path / "run"
    argv = ["train", str(TINY), "--out", str(out), "--quiet", "checkpoint_every=0"]
    assert runner.invoke(app, [*argv, "steps=1"]).exit_code == 0
    for path in (out / "checkpoints").rglob("*"):  # a run stopped before its first checkpoint
        if path.is_file():
            path.unlink()
    config = (out / "config.yaml").read_text()
    assert "model.dim (16 -> 32)" in one_line_error(runner.invoke(app, [*argv, "steps=1", "model.dim=32", "--resume"]))
    assert (out / "config.yaml").read_text() == config
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{}\n{"step": 1}\n')
    assert "line 2 is not a metrics record" in one_line_error(runner.invoke(app, [*argv, "steps=1", "--resume"]))


def test_bad_checkpoints_and_prompts_are_one_line(tmp_path):
    out = tmp_path / "run"
    assert runner.invoke(app, ["train", str(TINY), "--out", str(out), "--quiet", "steps=2"]).exit_code == 0
    checkpoint = latest_checkpoint(out)

    def error(*argv):
        return one_line_error(runner.invoke(app, list(argv)))

    assert "longer than allowed (48)" in error("generate", str(out), "--prompt", " ".join(["3"] * 49))
    assert "longer than allowed (2)" in error("generate", str(out), "--prompt", "1 2 3", "--max-prompt-tokens", "2")
    assert "space-separated token ids" in error("generate", str(out), "--prompt", "hello")
    assert "[0, 24)" in error("generate", str(out), "--prompt", "1 99")
    assert "series task" in error("eval", str(out), "--task", "forecast_sine")
    assert "smaller than task mqar" in error("eval", str(out), "--task", "mqar")
    assert "--lengths" in error("eval", str(out), "--lengths", "24,x")
    assert "length must be" in error("eval", str(out), "--lengths", "2")

    config = yaml.safe_load((checkpoint / "config.yaml").read_text())
    (checkpoint / "config.yaml").write_text(yaml.safe_dump({**config, "model": {**config["model"], "dim": 32}}))
    assert "does not match the model" in error("eval", str(out))
    (checkpoint / "config.yaml").write_text("steps: [")
    assert "invalid config.yaml" in error("eval", str(out))
    (checkpoint / "config.yaml").write_text(yaml.safe_dump(config))
    assert "already exists; pass --force" in error("eval", str(out), "--out", str(checkpoint / "model.safetensors"))
    (checkpoint / "model.safetensors").write_bytes(b"not a safetensors file")
    assert "corrupt" in error("eval", str(out))
    assert "corrupt" in error("train", str(TINY), "--out", str(out), "--resume", "steps=4")


def test_export_writes_a_pretrained_model_and_overwrites_nothing(tmp_path):
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(TINY), "--out", str(run), "--quiet", "steps=2"]).exit_code == 0
    out = tmp_path / "model"
    result = runner.invoke(app, ["export", str(run), str(out)])
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == str(out)
    exported = TitansLM.from_pretrained(out)
    trained = TitansLM(load_checkpoint_config(latest_checkpoint(run)).model)
    load_weights(latest_checkpoint(run), trained)
    x = torch.randint(0, 24, (2, 10))
    assert exported.config == trained.config and torch.equal(exported(x)[0], trained.eval()(x)[0])

    def error(*argv):
        return one_line_error(runner.invoke(app, list(argv)))

    (out / "notes.txt").write_text("mine")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert "already holds a saved model; pass --force" in error("export", str(run), str(out))
    assert "does not exist" in error("export", str(tmp_path / "missing"), str(tmp_path / "elsewhere"))
    (tmp_path / "empty").mkdir()
    assert "neither a checkpoint" in error("export", str(tmp_path / "empty"), str(tmp_path / "elsewhere"))
    assert "run or checkpoint directory" in error("export", str(run), str(run))
    assert "run or checkpoint directory" in error("export", str(run), str(latest_checkpoint(run)), "--force")
    (tmp_path / "file").write_text("x")
    assert "is a file" in error("export", str(run), str(tmp_path / "file"))
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before and not (tmp_path / "elsewhere").exists()
    result = runner.invoke(app, ["export", str(latest_checkpoint(run)), str(out), "--force"])  # a checkpoint folder
    assert result.exit_code == 0, result.output
    assert (out / "notes.txt").read_text() == "mine"  # --force replaces the model, nothing else

    forecaster = tmp_path / "forecaster"
    assert runner.invoke(app, ["train", str(TINY), "task.name=forecast_sine", "task.options={}", "steps=1", "--quiet",
                               "--out", str(forecaster)]).exit_code == 0
    assert "not a language model" in error("export", str(forecaster), str(tmp_path / "f"))
    assert not (tmp_path / "f").exists()
