"""Training as on a GPU, held on the CPU: bf16 autocast (float32 master weights and memory state), torch.compile of
the training forward, and a loop that reads its numbers back only at log/eval/checkpoint time."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

import titans.memory.parallel as parallel
from titans.cli import load_for_inference
from titans.train import EvalPlan, Trainer, evaluate, load_train_config, loop, train
from titans.train.checkpoint import latest_checkpoint
from titans.train.precision import autocast, parameter_dtype


def records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_precision_names():
    assert parameter_dtype("bfloat16") is torch.float32  # master weights
    assert parameter_dtype("float64") is torch.float64 and parameter_dtype("float32") is torch.float32
    with autocast("bfloat16", "cpu"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") is torch.bfloat16
    with autocast("float32", torch.device("cpu")):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="dtype must be one of float32, float64, bfloat16, got 'float16'"):
        parameter_dtype("float16")
    with pytest.raises(ValueError, match="dtype"):
        load_train_config(data={"dtype": "float16"})


@pytest.mark.parametrize("variant", ["lmm", "mac"])
def test_bfloat16_trains_with_float32_weights_and_memory_state(tiny_config, tmp_path, monkeypatch, variant):
    """Autocast reaches the model's matmuls (a projection outputs bf16) but not the memory: its chunk path gets
    float32 q, k, v, gates and state with autocast off, and hands back a float32 state."""
    seen = []
    real = parallel._scan_memory

    def spy(*args):
        tensors = [t for a in args for t in (a if isinstance(a, tuple) else (a,)) if isinstance(t, torch.Tensor)]
        seen.append(({t.dtype for t in tensors}, torch.is_autocast_enabled("cpu")))
        return real(*args)

    monkeypatch.setattr(parallel, "_scan_memory", spy)
    cfg = load_train_config(tiny_config, ["dtype=bfloat16", f"model.variant={variant}", "model.segment_len=8",
                                          "steps=24", "checkpoint_every=0"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    projected = []
    memory = trainer.model.backbone.blocks[0].mixer
    qkv = (memory.memory if variant == "mac" else memory).to_qkv
    qkv.register_forward_hook(lambda module, inputs, output: projected.append(output.dtype))
    losses = []
    for _ in range(cfg.steps):
        trainer.train_step()
        trainer.step += 1
        losses.append(trainer.last_read.loss)
    assert all(math.isfinite(loss) for loss in losses) and trainer.skipped_steps == 0
    assert sum(losses[-6:]) / 6 < sum(losses[:6]) / 6 - 0.3, losses  # from ln 24 = 3.18 towards ln 8 = 2.08
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    assert set(projected) == {torch.bfloat16}
    assert seen and all(dtypes == {torch.float32} and not autocast_on for dtypes, autocast_on in seen)
    _, state = trainer.model(torch.zeros(1, 8, dtype=torch.long))
    with autocast("bfloat16", "cpu"):
        _, state = trainer.model(torch.zeros(1, 8, dtype=torch.long), state)
    memory_state = state[0].memory if variant == "mac" else state[0]
    assert {w.dtype for w in (*memory_state.weights, *memory_state.momentum)} == {torch.float32}
    # evaluation under the run's autocast: finite, and the float32 evaluation of the same weights within bf16's
    # rounding (8 bits of mantissa: a relative error of 4e-3 per product)
    mixed = evaluate(trainer.model, trainer.eval_task, [24], EvalPlan(2, 8, precision="bfloat16"))[24]
    plain = evaluate(trainer.model, trainer.eval_task, [24], EvalPlan(2, 8))[24]
    assert mixed["loss"] == pytest.approx(plain["loss"], rel=2e-2) and mixed["loss"] != plain["loss"]


def test_bfloat16_checkpoint_records_and_loads_its_dtype(tiny_config, tmp_path, monkeypatch):
    """(Its resume is bit-identical: tests/train/test_checkpoint.py, parametrised over the dtype.)"""
    cfg = load_train_config(tiny_config, ["dtype=bfloat16", "steps=2", "checkpoint_every=2"])
    train(cfg, tmp_path / "straight", quiet=True)
    checkpoint = latest_checkpoint(tmp_path / "straight")
    assert "dtype: bfloat16" in (checkpoint / "config.yaml").read_text()
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert {w.dtype for w in weights.values()} == {torch.float32}  # master weights, not bf16 copies
    with pytest.raises(ValueError, match=r"dtype \('bfloat16' -> 'float32'\)"):
        Trainer(load_train_config(tiny_config, ["steps=2", "checkpoint_every=2"]), tmp_path / "straight").resume()

    _, loaded_cfg, _, model = load_for_inference(tmp_path / "straight", "cpu")
    assert loaded_cfg.dtype == "bfloat16" and {p.dtype for p in model.parameters()} == {torch.float32}
    precisions = []
    monkeypatch.setattr("titans.train.evaluate", lambda *a: precisions.append(a[3].precision) or {24: {}})
    from typer.testing import CliRunner

    from titans.cli import app

    CliRunner().invoke(app, ["eval", str(tmp_path / "straight"), "--lengths", "24"])
    assert precisions == ["bfloat16"]  # `titans eval` evaluates as the run trained


def test_compiled_training_matches_eager(tiny_config, tmp_path, monkeypatch):
    """torch.compile of the training forward gives the eager losses and weights. Dynamo's `eager` backend: it
    captures the graphs (and breaks them where the memory is left eager) and runs them without code generation,
    which inductor needs minutes for on two shared cores (`test_inductor_...` below, slow)."""
    real_compile = torch.compile
    compiled = []
    monkeypatch.setattr(torch, "compile", lambda model: compiled.append(model) or real_compile(model, backend="eager"))
    common = ["dtype=float64", "steps=3", "checkpoint_every=0"]
    eager = train(load_train_config(tiny_config, common), tmp_path / "eager", quiet=True)
    assert not compiled
    graph = train(load_train_config(tiny_config, [*common, "compile=true"]), tmp_path / "compiled", quiet=True)
    assert len(compiled) == 1
    assert graph.final_loss == pytest.approx(eager.final_loss, rel=1e-12)
    a = load_file(str(latest_checkpoint(tmp_path / "eager") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "compiled") / "model.safetensors"))
    assert a.keys() == b.keys()  # the checkpoint holds the model's own names, not the compiled wrapper's
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-12


@pytest.mark.slow
def test_inductor_compiled_training_matches_eager(tiny_config, tmp_path):
    common = ["steps=2", "checkpoint_every=0"]
    eager = train(load_train_config(tiny_config, common), tmp_path / "eager", quiet=True)
    graph = train(load_train_config(tiny_config, [*common, "compile=true"]), tmp_path / "compiled", quiet=True)
    # float32, inductor's fused kernels reorder sums: rounding only
    assert graph.final_loss == pytest.approx(eager.final_loss, rel=1e-5)
    assert graph.evaluation[24]["loss"] == pytest.approx(eager.evaluation[24]["loss"], rel=1e-4)


def poison(monkeypatch, steps):
    """The training loss NaN at the given (1-based) steps, as an overflow would make it."""
    calls = {"n": 0}
    real = loop.loss_terms

    def loss_terms(*args, **kwargs):
        total, outputs = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] in steps:
                total = total * math.nan
        return total, outputs

    monkeypatch.setattr(loop, "loss_terms", loss_terms)


def test_deferred_reads_give_the_records_and_weights_of_reading_every_step(tiny_config, tmp_path, monkeypatch):
    """The GPU loop (defer_reads: the fused AdamW skips a non-finite step on the device, the numbers are read at log
    time) against the loop that reads every step, on the CPU in float64 with three poisoned steps."""
    cfg = load_train_config(tiny_config, ["dtype=float64", "steps=9", "log_every=3", "checkpoint_every=0"])
    reads = {False: [], True: []}  # steps read back per read, of the loop that reads every step and of the other
    real_read = Trainer.read_steps
    monkeypatch.setattr(Trainer, "read_steps",
                        lambda self: reads[self.defer_reads].append(len(self.unread)) or real_read(self))
    runs = {}
    for defer in (False, True):
        poison(monkeypatch, {2, 3, 5})
        trainer = Trainer(cfg, tmp_path / str(defer), quiet=True, defer_reads=defer)
        assert trainer.optimizer.defaults["fused"] is defer
        runs[defer] = trainer.run()
    assert [n for n in reads[False] if n] == [1] * 9
    assert [n for n in reads[True] if n] == [3, 3, 3]  # once per log line, every step since the last
    assert runs[True].skipped_steps == runs[False].skipped_steps == 3
    assert runs[True].final_loss == pytest.approx(runs[False].final_loss, rel=1e-12)

    deferred, every = records(tmp_path / "True"), records(tmp_path / "False")
    assert [r["step"] for r in deferred if r.get("skipped")] == [2, 3, 5]
    assert len(deferred) == len(every)
    for mine, theirs in zip(deferred, every):  # the same records in the same order; fused vs foreach AdamW: rounding
        numbers = [(k, v) for k, v in loop._scalars(mine) if k not in ("tokens_per_s", "train_seconds")]
        expected = [(k, v) for k, v in loop._scalars(theirs) if k not in ("tokens_per_s", "train_seconds")]
        assert [k for k, _ in numbers] == [k for k, _ in expected]
        assert [v for _, v in numbers] == pytest.approx([v for _, v in expected], rel=1e-12, nan_ok=True)
        assert {k: v for k, v in mine.items() if not isinstance(v, (float, dict))} == \
            {k: v for k, v in theirs.items() if not isinstance(v, (float, dict))}
    a = load_file(str(latest_checkpoint(tmp_path / "True") / "model.safetensors"))
    b = load_file(str(latest_checkpoint(tmp_path / "False") / "model.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-12  # fused vs foreach AdamW: rounding only


def test_deferred_reads_still_stop_after_too_many_skips_in_a_row(tiny_config, tmp_path, monkeypatch):
    cfg = load_train_config(tiny_config, ["max_skips_in_row=3", "steps=10", "log_every=4", "checkpoint_every=0"])
    poison(monkeypatch, {2, 3, 5, 6, 7, 8})
    trainer = Trainer(cfg, tmp_path / "run", quiet=True, defer_reads=True)
    with pytest.raises(ValueError, match=r"training diverged: 3 steps in a row \(up to step 7\)"):
        trainer.run()
    assert trainer.step == 8  # read at step 8's log line: one step past the limit, never applied
