"""The loop: schedule, seeding, weight-decay groups, accumulation, determinism, learning, metrics, time budget."""

import json
import math
from pathlib import Path

import pytest
import torch

from titans.tasks import get_task
from titans.train import (
    EvalPlan,
    OptimConfig,
    Trainer,
    batches,
    build_model,
    build_task,
    evaluate,
    evaluation,
    load_train_config,
    loop,
    lr_at,
    train,
)
from titans.train.batches import derive_seed, sample_rows
from titans.train.checkpoint import latest_checkpoint, list_checkpoints
from titans.train.loop import make_optimizer


def test_schedule_warmup_then_cosine_to_the_floor():
    optim = OptimConfig(lr=1.0, warmup_steps=10, min_lr_ratio=0.1)  # 111 steps: 0 … 110, decay over 10 … 110
    assert [lr_at(s, optim, 111) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert lr_at(10, optim, 111) == pytest.approx(1.0)
    assert lr_at(60, optim, 111) == pytest.approx(0.55)  # half way: (1 + 0.1) / 2
    assert lr_at(85, optim, 111) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.75)))
    assert lr_at(110, optim, 111) == pytest.approx(0.1)  # the last step the loop runs is at the floor
    assert lr_at(109, optim, 111) > 0.1
    assert lr_at(500, optim, 111) == pytest.approx(0.1)
    assert lr_at(0, OptimConfig(lr=2.0, warmup_steps=0, min_lr_ratio=0.0), 10) == pytest.approx(2.0)


def test_derived_seeds_are_stable_and_distinct():
    assert derive_seed(0) == 0xE220A8397B1DCDAF >> 1  # SplitMix64's published first output for seed 0
    assert derive_seed(0, 1, 2) == 3384391416029321617  # pinned: a change would silently change every data stream
    seeds = {derive_seed(stream, seed, step, row) for stream in (1, 2) for seed in range(3) for step in range(20)
             for row in range(8)}
    assert len(seeds) == 2 * 3 * 20 * 8
    assert all(0 <= s < 2**63 for s in seeds)


def test_rows_do_not_depend_on_who_draws_them():
    task = get_task("mqar", vocab=64, num_pairs=4)
    whole = sample_rows(task, range(6), 32, 1, 0, 5)
    halves = [sample_rows(task, range(3), 32, 1, 0, 5), sample_rows(task, range(3, 6), 32, 1, 0, 5)]
    assert torch.equal(whole.inputs, torch.cat([h.inputs for h in halves]))
    assert torch.equal(whole.targets, torch.cat([h.targets for h in halves]))
    assert not torch.equal(whole.inputs, sample_rows(task, range(6), 32, 1, 0, 6).inputs)  # next step


def test_weight_decay_only_on_linear_matrices(tiny_config):
    cfg = load_train_config(tiny_config, ["model.variant=mac", "model.segment_len=8"])
    model = build_model(cfg, build_task(cfg))
    decayed, plain = make_optimizer(model, cfg.optim).param_groups
    names = {id(p): n for n, p in model.named_parameters()}
    decayed_names = {names[id(p)] for p in decayed["params"]}
    plain_names = {names[id(p)] for p in plain["params"]}
    assert decayed["weight_decay"] == cfg.optim.weight_decay and plain["weight_decay"] == 0.0
    assert len(decayed_names) + len(plain_names) == len(names)
    assert all(n.endswith(".weight") and "norm" not in n and "conv" not in n for n in decayed_names)
    assert {"embed.weight", "backbone.blocks.0.mixer.persistent.tokens",
            "backbone.blocks.0.mixer.memory.initial_weights.0"} <= plain_names
    assert "backbone.blocks.0.mixer.attention.qkv.weight" in decayed_names
    gates = "backbone.blocks.0.mixer.memory.to_gates.weight"
    assert gates in decayed_names  # decay_gates: true, what runs before the option did
    decayed, plain = make_optimizer(model, cfg.optim.replace(decay_gates=False)).param_groups
    assert {names[id(p)] for p in decayed["params"]} == decayed_names - {gates}
    assert gates in {names[id(p)] for p in plain["params"]}


def final_weights(run_dir):
    from safetensors.torch import load_file

    return load_file(str(latest_checkpoint(run_dir) / "model.safetensors"))


def max_difference(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_accumulation_matches_one_big_batch(tiny_config, tmp_path):
    common = ["dtype=float64", "checkpoint_every=0", "steps=4", "batch_size=8"]
    one = train(load_train_config(tiny_config, common), tmp_path / "one", quiet=True)
    four = train(load_train_config(tiny_config, common + ["optim.grad_accum=4"]), tmp_path / "four", quiet=True)
    assert four.final_loss == pytest.approx(one.final_loss, rel=1e-12)
    assert max_difference(final_weights(tmp_path / "one"), final_weights(tmp_path / "four")) < 1e-12


def test_training_is_deterministic_and_learns(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["steps=60", "checkpoint_every=0", "log_every=20"])
    untrained = Trainer(cfg, tmp_path / "untrained")
    before = evaluate(untrained.model, untrained.task, [24], EvalPlan(4, 8))[24]["loss"]
    result = train(cfg, tmp_path / "a", quiet=True)
    train(cfg, tmp_path / "b", quiet=True)
    a, b = final_weights(tmp_path / "a"), final_weights(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)
    after = evaluate(build_and_load(cfg, tmp_path / "a"), untrained.task, [24], EvalPlan(4, 8))[24]["loss"]
    # chance over all 24 tokens is ln 24 = 3.18; a model that learned to answer with one of the 8 value tokens
    # is at ln 8 = 2.08 or below
    assert before > 3.0 and after < 2.3, (before, after)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if "loss" in r]
    assert [r["step"] for r in train_records] == [20, 40, 60]
    assert all({"lr", "grad_norm", "tokens_per_s", "skipped_steps"} <= r.keys() for r in train_records)
    assert records[-1]["final"] and set(records[-1]["eval"]) == {"24", "48"}
    summary = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert summary["results"]["24"] == pytest.approx(result.evaluation[24])
    assert summary["step"] == 60 and summary["num_parameters"] == result.num_parameters


def build_and_load(cfg, run_dir):
    from titans.train.checkpoint import load_weights

    model = build_model(cfg, build_task(cfg))
    load_weights(latest_checkpoint(run_dir), model)
    return model


def test_evaluation_set_is_fixed_whatever_the_batch_size(tiny_config):
    cfg = load_train_config(tiny_config)
    model = build_model(cfg, build_task(cfg)).double()
    task = build_task(cfg)
    by_two = evaluate(model, task, [24, 48], EvalPlan(batches=3, batch_size=2))
    by_six = evaluate(model, task, [24, 48], EvalPlan(batches=1, batch_size=6))
    for length in (24, 48):
        assert by_two[length] == pytest.approx(by_six[length], rel=1e-12)
        assert 0.0 <= by_two[length]["accuracy"] <= 1.0
    assert by_two[24] != evaluate(model, task, [24], EvalPlan(batches=3, batch_size=2, seed=1))[24]


def test_loss_by_position_is_the_mean_of_each_span_of_positions(tiny_config):
    """Against a plain reference: each sequence through the model whole, the cross-entropy at every position, the
    mean over the rows and over each span (float64, 1e-12). On lm_bytes every position is scored, so the spans'
    mean is the loss; on passkey only the answer at the end is, so the earlier spans hold nothing."""
    cfg = load_train_config(tiny_config, ["task.name=lm_bytes", "task.options={}", "model.vocab_size=256"])
    task = get_task("lm_bytes", split="val")
    torch.manual_seed(0)
    model = build_model(cfg, task).double()
    metrics = evaluate(model, task, [30], EvalPlan(batches=2, batch_size=3, position_buckets=4))[30]
    batch = sample_rows(task, range(6), 30, batches.EVAL_STREAM, 0, 30)
    losses = torch.stack([torch.nn.functional.cross_entropy(model(row[None])[0][0], target, reduction="none")
                          for row, target in zip(batch.inputs, batch.targets)]).mean(0)
    assert metrics["position_ends"] == [7, 15, 22, 30]
    expected = [losses[a:b].mean().item() for a, b in ((0, 7), (7, 15), (15, 22), (22, 30))]
    assert metrics["loss_by_position"] == pytest.approx(expected, rel=1e-12)
    assert metrics["bits_per_byte_by_position"] == pytest.approx([v / math.log(2) for v in expected], rel=1e-12)
    assert sum(v * n for v, n in zip(expected, (7, 8, 7, 8))) / 30 == pytest.approx(metrics["loss"], rel=1e-12)
    plain = load_train_config(tiny_config)
    passkey = evaluate(build_model(plain, build_task(plain)).double(), build_task(plain), [24],
                       EvalPlan(1, 4, position_buckets=3))[24]
    assert passkey["loss_by_position"][:2] == [None, None] and passkey["loss_by_position"][2] > 0
    assert "bits_per_byte_by_position" not in passkey


def test_position_buckets_are_refused_where_they_cannot_be_kept(tiny_config):
    with pytest.raises(ValueError, match=r"eval_position_buckets \(30\) must be at most the shortest"):
        load_train_config(tiny_config, ["eval_position_buckets=30"])
    with pytest.raises(ValueError, match="position_buckets is for token tasks; forecast_sine"):
        evaluate(None, get_task("forecast_sine"), [24], EvalPlan(1, 1, position_buckets=2))
    with pytest.raises(ValueError, match="between 1 and the length"):
        evaluation.position_ends(4, 5)


def test_time_budget_stops_early_with_a_checkpoint(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["steps=1000", "time_budget_s=1.0e-9", "checkpoint_every=0"])
    result = train(cfg, tmp_path / "run", quiet=True)
    assert result.step == 1
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_0000001"]
    assert set(result.evaluation) == {24, 48}


def test_series_tasks_train_a_forecaster(tiny_config, tmp_path):
    cfg = load_train_config(tiny_config, ["task.name=forecast_sine", "task.options={num_features: 3}",
                                          "steps=3", "model.variant=mag", "model.window=8"])
    result = train(cfg, tmp_path / "run", quiet=True)
    assert set(result.evaluation[24]) == {"loss", "persistence_loss"} and 0 < result.evaluation[24]["loss"] < 10


class Repeat(torch.nn.Module):
    """The persistence forecast as a model: every position's forecast of the next step is its own input (for tokens,
    logits that pick the input token)."""

    def __init__(self, vocab_size=1):
        super().__init__()
        self.vocab_size = vocab_size
        self.unused = torch.nn.Parameter(torch.zeros(1))  # evaluate reads the parameters' dtype

    def forward(self, x, state=None):
        return (x if x.is_floating_point() else torch.nn.functional.one_hot(x, self.vocab_size).float()), state


def test_persistence_loss_is_the_last_value_as_the_forecast_on_the_evaluated_sequences():
    """A model that repeats its input scores exactly the persistence loss, and that loss is the mean squared
    step of the evaluation sequences (the same rows evaluate draws: seeds (stream, seed, length, row))."""
    task = get_task("forecast_sine", num_features=2)
    result = evaluate(Repeat(), task, [30], EvalPlan(batches=2, batch_size=3))[30]
    batch = sample_rows(task, range(6), 30, batches.EVAL_STREAM, 0, 30)
    steps = (batch.targets.double() - batch.inputs.double()) ** 2
    assert result["persistence_loss"] == pytest.approx(steps.mean().item(), rel=1e-12)
    assert result["loss"] == pytest.approx(result["persistence_loss"], rel=1e-6)  # the model's loss in float32
    copy = get_task("copy")
    token_task = evaluate(Repeat(copy.vocab_size), copy, [30], EvalPlan(1, 2))[30]
    assert "persistence_loss" not in token_task  # token tasks: none


def test_classification_tasks_train_a_classifier_scored_on_the_whole_test_split(tiny_config, tmp_path):
    """A UCR set (the toy one in tests/data/ucr): a TitansEncoder with a linear classifier of its last hidden state,
    cross-entropy per series, and the accuracy over every series of the TEST split, each read once, whatever
    eval_batches says; reading the series in pieces through the state gives the same logits."""
    from titans.models import ClassificationHead

    root = Path(__file__).resolve().parents[1] / "data" / "ucr"
    cfg = load_train_config(tiny_config, [f"task={{name: ucr, options: {{dataset: Toy, root: {root}}}, "
                                          "train_length: 12, eval_lengths: [12]}", "steps=3", "model.variant=mag",
                                          "model.window=8", "eval_batches=1", "eval_batch_size=4"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    assert isinstance(trainer.model, ClassificationHead) and trainer.eval_task.options.split == "test"
    result = trainer.run().evaluation[12]
    assert set(result) == {"loss", "accuracy", "examples"} and result["examples"] == 6  # the test file's 6 series
    whole = trainer.eval_task.full_set(12)
    with torch.no_grad():
        logits = trainer.model(whole.inputs)[0]
    assert result["accuracy"] == pytest.approx((logits.argmax(-1) == whole.targets).float().mean().item())
    assert result["loss"] == pytest.approx(torch.nn.functional.cross_entropy(logits, whole.targets).item(), rel=1e-5)
    pieces = evaluate(trainer.model, trainer.eval_task, [12], EvalPlan(1, 6, piece=5))[12]
    assert pieces["accuracy"] == result["accuracy"] and pieces["loss"] == pytest.approx(result["loss"], rel=1e-4)


def test_dropout_masks_depend_on_the_step_not_on_what_ran_before(tiny_config, tmp_path):
    import copy

    trainer = Trainer(load_train_config(tiny_config, ["model.dropout=0.3"]), tmp_path / "run", quiet=True)
    trainer.step = 5
    model, optimizer = copy.deepcopy(trainer.model.state_dict()), copy.deepcopy(trainer.optimizer.state_dict())
    trainer.train_step()
    first = trainer.last_read
    trainer.model.load_state_dict(model)
    trainer.optimizer.load_state_dict(optimizer)
    torch.rand(1000)  # the global RNG moved on
    trainer.train_step()
    assert trainer.last_read == first
    trainer.model.load_state_dict(model)
    trainer.optimizer.load_state_dict(optimizer)
    trainer.rank = 1  # another DDP rank (and its rows of the batch): other masks
    trainer.train_step()
    assert trainer.last_read.loss != first.loss


def test_data_tasks_evaluate_on_their_validation_split(tiny_config, tmp_path):
    """A CSV whose validation rows differ from its training rows: training reports the validation split, and
    an evaluation length the validation split cannot hold fails before any training."""
    rows = ["date,a,b"] + [f"{i},{i % 5},{(i * 7) % 11}" for i in range(700)] + \
        [f"{i},{100 + i},{-3.0 * i}" for i in range(700, 1000)]
    (tmp_path / "s.csv").write_text("\n".join(rows) + "\n")
    overrides = ["task.name=forecast_csv", f"task.options={{path: {tmp_path / 's.csv'}}}", "steps=2",
                 "model.variant=mag", "model.window=8"]
    trainer = Trainer(load_train_config(tiny_config, overrides), tmp_path / "run", quiet=True)
    assert trainer.task.options.split == "train" and trainer.eval_task.options.split == "val"
    reported = trainer.run().evaluation[24]["loss"]
    on_val = evaluate(trainer.model, trainer.eval_task, [24], EvalPlan(1, 8))[24]["loss"]
    on_train = evaluate(trainer.model, trainer.task, [24], EvalPlan(1, 8))[24]["loss"]
    assert reported == pytest.approx(on_val) and on_val != pytest.approx(on_train)
    with pytest.raises(ValueError, match="length 120 is too long for the val split"):  # 100 validation rows
        Trainer(load_train_config(tiny_config, [*overrides, "task.eval_lengths=[24,120]"]), tmp_path / "r2", quiet=True)
    assert not (tmp_path / "r2" / "metrics.jsonl").exists()


def test_tensorboard_gets_every_number(tiny_config, tmp_path, monkeypatch):
    scalars = []

    class FakeWriter:
        def add_scalar(self, tag, value, step):
            scalars.append((tag, step))

        def close(self):
            scalars.append(("closed", -1))

    monkeypatch.setattr(loop, "tensorboard_writer", lambda path: FakeWriter())
    train(load_train_config(tiny_config, ["tensorboard=true", "steps=2"]), tmp_path / "run", quiet=True)
    assert ("loss", 1) in scalars and ("lr", 2) in scalars and ("eval/48/accuracy", 2) in scalars
    assert scalars[-1] == ("closed", -1)


def poison_steps(monkeypatch, steps, factor=math.nan):
    """Multiply the training loss by `factor` at the given (1-based) steps: NaN by default, as an overflow in the
    backward pass would make it; a large finite factor makes a gradient spike."""
    calls = {"n": 0}
    real = batches.loss_terms

    def loss_terms(model, batch, device, piece=None, precision="float32"):
        total, outputs = real(model, batch, device, piece, precision)
        if torch.is_grad_enabled():  # training, not evaluation
            calls["n"] += 1
            if calls["n"] in steps:
                total = total * factor
        return total, outputs

    monkeypatch.setattr(loop, "loss_terms", loss_terms)


def test_the_largest_gradient_norm_is_kept_with_its_step_and_survives_a_resume(tiny_config, tmp_path, monkeypatch):
    """A finite spike (the loss scaled up 10^6 at step 3) is clipped, not skipped, and still seen: the run's largest
    gradient norm before clipping and its step go to the result, eval.json and the checkpoint."""
    cfg = load_train_config(tiny_config, ["checkpoint_every=0"])
    clean = train(cfg, tmp_path / "clean", quiet=True)
    poison_steps(monkeypatch, {3}, factor=1e6)
    result = train(cfg, tmp_path / "run", quiet=True)
    peak, step = result.peak_grad
    assert step == 3 and result.skipped_steps == 0
    assert peak > 1e4 * clean.peak_grad[0] > 0 and clean.peak_grad[1] >= 1
    saved = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert (saved["peak_grad_norm"], saved["peak_grad_step"]) == (peak, 3)
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    assert trainer.resume() and trainer.peak_grad == (peak, 3)


def test_the_share_of_thetas_the_momentum_bound_lowered_is_recorded_and_survives_a_resume(tiny_config, tmp_path):
    """eval.json keeps the share of learned θ_t that κ lowered in training (a run where it acted is not the paper's
    free-gates run), carried across a resume as the straight run counts it; None where nothing was bounded."""
    cfg = load_train_config(tiny_config, ["checkpoint_every=3", "model.memory_max_momentum_step=0.1"])
    straight = train(cfg, tmp_path / "straight", quiet=True)
    lowered, bounded = straight.momentum_bound
    assert 0 < lowered <= bounded
    saved = json.loads((tmp_path / "straight" / "eval.json").read_text())
    assert saved["momentum_bound_share"] == lowered / bounded
    interrupted = Trainer(cfg, tmp_path / "split", quiet=True)
    for _ in range(3):
        interrupted.train_step()
        interrupted.step += 1
    interrupted.save()
    resumed = Trainer(cfg, tmp_path / "split", quiet=True)
    assert resumed.resume() and 0 < resumed.earlier_bound[1] < bounded
    assert resumed.run().momentum_bound == (lowered, bounded)
    free = load_train_config(tiny_config, ["checkpoint_every=0", "model.memory_max_momentum_step=null"])
    assert train(free, tmp_path / "free", quiet=True).momentum_bound == (0, 0)
    assert json.loads((tmp_path / "free" / "eval.json").read_text())["momentum_bound_share"] is None


def test_non_finite_steps_are_skipped_counted_and_logged(tiny_config, tmp_path, monkeypatch, capsys):
    cfg = load_train_config(tiny_config, ["checkpoint_every=0"])
    clean = train(cfg, tmp_path / "clean", quiet=True)
    poison_steps(monkeypatch, {2, 3, 5})
    result = train(cfg, tmp_path / "run", quiet=True)
    assert result.skipped_steps == 3 and result.step == 6
    weights = final_weights(tmp_path / "run")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert max_difference(weights, final_weights(tmp_path / "clean")) > 0  # three updates fewer
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skips = [r for r in records if r.get("skipped")]
    assert [(r["step"], r["skips_in_row"], r["skipped_steps"]) for r in skips] == [(2, 1, 1), (3, 2, 2), (5, 1, 3)]
    assert all(math.isnan(r["loss"]) for r in skips)
    assert [r["skipped_steps"] for r in records if "lr" in r] == [0, 1, 2, 2, 3, 3]
    assert json.loads((tmp_path / "run" / "eval.json").read_text())["skipped_steps"] == 3
    assert clean.skipped_steps == 0
    assert "step 5 skipped" in capsys.readouterr().err


def test_too_many_skips_in_a_row_stop_with_an_error(tiny_config, tmp_path, monkeypatch):
    cfg = load_train_config(tiny_config, ["checkpoint_every=0", "max_skips_in_row=3", "steps=10"])
    poison_steps(monkeypatch, {2, 3, 5, 6, 7, 8})
    with pytest.raises(ValueError, match=r"training diverged: 3 steps in a row \(up to step 7\).*max_skips_in_row=3"):
        train(cfg, tmp_path / "run", quiet=True)
