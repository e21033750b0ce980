"""`titans bench backward`: a checkpoint replayed on its training batches, held to the trainer's own log and to a
plain recomputation of the state's gradient."""

import json
import math

import pytest
import torch
from typer.testing import CliRunner

from titans.bench.backward import Replay, load_replay, read_in_pieces, replay, replay_step, update_chain
from titans.cli import app
from titans.train import train
from titans.train.batches import TRAIN_STREAM, position_loss, sample_rows, scored_positions
from titans.train.config import TrainConfig


def tiny_run(tmp_path, variant: str, **model) -> TrainConfig:
    """Three steps of a two-block model, a checkpoint after each, every step logged."""
    cfg = TrainConfig.from_dict({
        "name": "tiny", "model": {"variant": variant, "dim": 16, "depth": 2, "heads": 2, "chunk_size": 4,
                                  "segment_len": 8, "window": 8, "n_persistent": 2, "memory_expansion": 2, **model},
        "task": {"name": "passkey", "options": {"vocab": 24, "num_values": 8}, "train_length": 32,
                 "eval_lengths": [32]},
        "optim": {"lr": 0.01, "warmup_steps": 1}, "steps": 3, "batch_size": 4, "eval_batches": 1,
        "eval_batch_size": 4, "checkpoint_every": 1, "keep_checkpoints": 5, "log_every": 1, "threads": 1,
        "tensorboard": False})
    train(cfg, tmp_path / "run", quiet=True)
    return cfg


def logged(run_dir, step: int) -> dict:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("step") == step and "grad_norm" in record:
            return record
    raise AssertionError(f"no training record of step {step}")


@pytest.mark.parametrize("variant", ["mac", "lmm", "mag", "mal"])
def test_replay_is_the_step_the_trainer_took(tmp_path, variant):
    """From the checkpoint after step 1, the batch of step index 1 gives the loss and the gradient norm before
    clipping that the trainer logged for its second step."""
    tiny_run(tmp_path, variant)
    _, _, (r,) = replay(tmp_path / "run" / "checkpoints" / "step_0000001", [1], None, [])
    record = logged(tmp_path / "run", 2)
    assert r.step == 1
    assert r.loss == pytest.approx(record["loss"], rel=1e-5)
    assert r.grad_norm == pytest.approx(record["grad_norm"], rel=1e-4)


def test_state_gradient_is_the_gradient_of_the_rest_of_the_sequence(tmp_path):
    """The norm at boundary i is ‖∂loss/∂state_i‖: recomputed by cutting the stream at i and continuing it from
    leaf copies of the state (only the pieces after i depend on it)."""
    tiny_run(tmp_path, "lmm", depth=1)
    path, cfg, task, model = load_replay(tmp_path / "run", [])
    piece = cfg.model.memory.chunk_size
    r = replay_step(model, cfg, task, 2, piece)
    batch = sample_rows(task, range(cfg.batch_size), cfg.task.train_length, TRAIN_STREAM, cfg.seed, 2)
    cut = 3  # boundary after the fourth piece
    inputs, outputs, state = batch.inputs, [], None
    for start in range(0, inputs.shape[1], piece):
        out, state = model(inputs[:, start:start + piece], state)
        if start // piece == cut:
            memory = state[0]
            leaves = [t.detach().requires_grad_() for t in (*memory.weights, *memory.momentum)]
            depth = len(memory.weights)
            state = [type(memory)(**{**memory.__dict__, "weights": leaves[:depth], "momentum": leaves[depth:]})]
        outputs.append(out)
    loss = position_loss(torch.cat(outputs, 1), batch, torch.device("cpu"), torch.float32) / scored_positions(batch)
    grads = torch.autograd.grad(loss, leaves)
    expected = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    assert r.state_grad_norms[0][cut] == pytest.approx(expected, rel=1e-5)
    assert len(r.state_grad_norms) == cfg.model.depth == 1
    assert len(r.state_grad_norms[0]) == cfg.task.train_length // piece - 1  # the last boundary has nothing after it
    assert all(n is not None and n > 0 for n in r.state_grad_norms[0])


def test_float64_replay_is_the_same_step_in_double_precision(tmp_path):
    """On a healthy model the exact (float64) replay and the float32 one agree; the JSON names the precision. Agree to
    RMSNorm's epsilon, not to float32's rounding: torch's default epsilon is the dtype's (1.2e-7 in float32, 2.2e-16 in
    float64), and the memory's reads early in a sequence are small enough for it to matter: MAC's gradient norm here
    differs by 2e-4 relative, its loss by 7e-7 (a model's logits, 4e-3 in float32 against float64, 2e-6 with one fixed
    epsilon; DESIGN.md §1's open items)."""
    tiny_run(tmp_path, "mac")
    _, _, (single,) = replay(tmp_path / "run", [2], None, [])
    _, _, (double,) = replay(tmp_path / "run", [2], None, [], torch.float64)
    assert double.loss == pytest.approx(single.loss, rel=1e-5)
    assert double.grad_norm == pytest.approx(single.grad_norm, rel=1e-3)
    out = tmp_path / "double.json"
    result = CliRunner().invoke(app, ["bench", "backward", str(tmp_path / "run"), "--float64", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads(out.read_text())["dtype"] == "float64" and "float64" in result.output


def test_growth_is_the_largest_factor_one_segment_multiplies_the_gradient():
    r = Replay(0, 1.0, 1.0, [[8.0, 2.0, 1.0], [None, 1.0, 3.0], [5.0]], [[1.0, 1.0, 1.0], [9.0, 3.0, 3.0], [None]])
    assert r.growth() == [4.0, pytest.approx(1 / 3), None]
    assert r.update_growth() == [1.0, 3.0, None]


@pytest.mark.parametrize("variant", ["mac", "lmm", "mag", "mal"])
def test_the_memory_alone_fed_its_recorded_writes_carries_the_model_states(tmp_path, variant):
    """The update-alone chain is the memory's part of the model's recurrence: from the state after the first piece,
    the recorded write inputs alone give the states the model carried at every later boundary (float64)."""
    tiny_run(tmp_path, variant)
    _, cfg, task, model = load_replay(tmp_path / "run", [], torch.float64)
    batch = sample_rows(task, range(cfg.batch_size), cfg.task.train_length, TRAIN_STREAM, cfg.seed, 1)
    memories, _, boundaries, writes = read_in_pieces(model, batch.inputs, 8)
    assert len(memories) == cfg.model.depth == len(writes) and all(len(w) == len(boundaries) for w in writes)
    for b, memory in enumerate(memories):
        chain = update_chain(memory, writes[b][1:], boundaries[0][b][0][0])
        for state, boundary in zip(chain, boundaries):
            (carried,) = boundary[b][0]
            for ours, theirs in zip((*state.weights, *state.momentum), (*carried.weights, *carried.momentum)):
                torch.testing.assert_close(ours, theirs, rtol=1e-12, atol=1e-12)


def test_the_update_alone_starts_from_the_full_gradient_at_the_last_boundary(tmp_path):
    tiny_run(tmp_path, "mac")
    _, cfg, task, model = load_replay(tmp_path / "run", [], torch.float64)
    r = replay_step(model, cfg, task, 2, 8)
    assert len(r.update_grad_norms) == len(r.state_grad_norms) == 2
    for full, alone in zip(r.state_grad_norms, r.update_grad_norms):
        assert len(alone) == len(full) and alone[-1] == pytest.approx(full[-1], rel=1e-12)
        assert all(n is not None and math.isfinite(n) for n in alone)


def test_set_replays_the_same_weights_under_another_rule(tmp_path):
    tiny_run(tmp_path, "mac")
    _, cfg, _, model = load_replay(tmp_path / "run", ["model.memory_hidden_step=0.1"])
    _, _, _, plain = load_replay(tmp_path / "run", [])
    assert cfg.model.memory.hidden_step == 0.1
    assert load_replay(tmp_path / "run", ["model.memory.hidden_step=0.2"])[1].model.memory.hidden_step == 0.2
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("overrides, piece, message", [
    (["optim.lr=1"], None, "model fields only"),
    (["model.dim=32"], None, "model.dim=32: .* keep the parameters' shapes"),
    ([], 4, "multiple of 8"),
])
def test_bad_replays_are_refused(tmp_path, overrides, piece, message):
    tiny_run(tmp_path, "mac")
    with pytest.raises((ValueError, RuntimeError), match=message):
        replay(tmp_path / "run", None, piece, overrides)


def test_a_model_without_memory_is_refused(tmp_path):
    tiny_run(tmp_path, "swa")
    with pytest.raises(ValueError, match="no neural memory"):
        replay(tmp_path / "run", None, None, [])


def test_cli_writes_the_replays_and_refuses_bad_input(tmp_path):
    tiny_run(tmp_path, "mac")
    out = tmp_path / "backward.json"
    result = CliRunner().invoke(app, ["bench", "backward", str(tmp_path / "run"), "--steps", "0,2",
                                      "--set", "model.memory_max_grad_norm=1", "--out", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert [r["step"] for r in data["replays"]] == [0, 2] and data["overrides"] == ["model.memory_max_grad_norm=1"]
    assert all(len(r["state_grad_norms"]) == len(r["update_grad_norms"]) == 2 and len(r["growth"]) == 2
               and len(r["update_growth"]) == 2 for r in data["replays"])
    assert "step 2: loss" in result.output
    bad = CliRunner().invoke(app, ["bench", "backward", str(tmp_path / "run"), "--piece", "3", "--out",
                                   str(tmp_path / "bad.json")])
    assert bad.exit_code != 0 and "multiple of 8" in bad.output and not (tmp_path / "bad.json").exists()
    missing = CliRunner().invoke(app, ["bench", "backward", str(tmp_path / "nowhere")])
    assert missing.exit_code != 0
