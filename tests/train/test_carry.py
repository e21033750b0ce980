"""`carry_windows`: training on consecutive windows of one sequence with the recurrent state carried between steps
(truncated backpropagation through time), exact against the model reading the whole sequence, and resumable."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from titans.io.state import state_nodes
from titans.train import Trainer, load_train_config
from titans.train.batches import TRAIN_STREAM, sample_rows
from titans.train.checkpoint import CARRIED_FILE, list_checkpoints

from .test_checkpoint import weights

LM = ["task.name=lm_bytes", "task.options={}", "model.vocab_size=256", "task.train_length=16",
      "task.eval_lengths=[16]", "batch_size=2"]


def frozen(trainer: Trainer) -> Trainer:
    """`trainer` with its optimiser's step a no-op: the weights stay as built, so each step's loss is the model's."""
    trainer.optimizer.step = lambda *args, **kwargs: None
    return trainer


@pytest.mark.parametrize("variant", ["lmm", "mac", "mag", "mal", "swa", "lstm", "gated_deltanet"])
def test_each_step_reads_the_next_window_from_the_state_the_last_one_left(tiny_config, tmp_path, variant):
    """With the weights fixed, step k's loss is the model's mean loss over window k of the block's sequence read
    whole (float64, 1e-10), and a new block starts from a fresh state: step 3 of carry_windows=3 is step 0 of the
    next block's sequence."""
    cfg = load_train_config(tiny_config, [*LM, f"model.variant={variant}", "carry_windows=3", "dtype=float64",
                                          "model.window=8", "model.segment_len=8"])
    trainer = frozen(Trainer(cfg, tmp_path / "run", quiet=True))
    losses = []
    for _ in range(4):
        trainer.train_step()
        trainer.step += 1
        losses.append(trainer.last_read.loss)
    model, length = trainer.model.eval(), cfg.task.train_length
    for block, windows in ((0, range(3)), (1, range(1))):
        sequence = sample_rows(trainer.task, range(cfg.batch_size), 3 * length, TRAIN_STREAM, cfg.seed, block)
        with torch.no_grad():
            logits, _ = model(sequence.inputs)
        for k in windows:
            span = slice(k * length, (k + 1) * length)
            expected = F.cross_entropy(logits[:, span].flatten(0, 1), sequence.targets[:, span].flatten())
            assert losses[3 * block + k] == pytest.approx(expected.item(), abs=1e-10, rel=1e-10)


def test_the_carried_state_takes_no_gradient_into_the_past(tiny_config, tmp_path):
    """Each step backpropagates through its own window only: the state it starts from is detached (the second
    backward would otherwise fail on the freed graph of the first window, or reach into it)."""
    cfg = load_train_config(tiny_config, [*LM, "carry_windows=2"])
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    trainer.train_step()
    trainer.step += 1
    leaves = [t for t in _tensors(trainer.carried) if t.is_floating_point()]
    assert leaves and all(not t.requires_grad and t.grad_fn is None for t in leaves)
    trainer.train_step()  # backward through window 1 only
    trainer.step += 1
    assert trainer.carried is None  # the block of two windows is done: the next step starts fresh


def test_a_skipped_step_does_not_pass_its_state_on(tiny_config, tmp_path, monkeypatch):
    """A window whose loss is not finite is skipped, counted, and the next window starts from a fresh state rather
    than from what made it non-finite."""
    import titans.train.loop as loop

    real = loop.carried_loss_terms

    def poisoned_once(model, batch, device, state, precision):
        loss, end = real(model, batch, device, state, precision)
        if not calls:
            loss, end = loss * float("nan"), [torch.full_like(t, float("nan")) for t in _tensors(end)]
        calls.append(state)
        return loss, end

    calls = []
    monkeypatch.setattr(loop, "carried_loss_terms", poisoned_once)
    (tmp_path / "run").mkdir()  # the skip is logged there
    trainer = Trainer(load_train_config(tiny_config, [*LM, "carry_windows=3"]), tmp_path / "run", quiet=True)
    trainer.train_step()
    trainer.step += 1
    assert trainer.skipped_steps == 1 and trainer.carried is None
    trainer.train_step()
    trainer.step += 1
    assert calls[1] is None and trainer.skipped_steps == 1 and trainer.carried is not None


def _tensors(node):
    return [n for n in state_nodes(node) if isinstance(n, torch.Tensor)]


@pytest.mark.parametrize("variant", ["lmm", "mac"])
def test_a_run_stopped_inside_a_block_resumes_with_its_carried_state(tiny_config, tmp_path, variant):
    """A checkpoint inside a block of windows keeps the states its next step starts from; the resumed run ends
    with the weights of the run that never stopped, and a resume that lost them does not (the test can fail)."""
    cfg = load_train_config(tiny_config, [*LM, f"model.variant={variant}", "carry_windows=3", "steps=6",
                                          "checkpoint_every=0", "model.window=8", "model.segment_len=8"])
    straight = Trainer(cfg, tmp_path / "straight", quiet=True)
    straight.run()

    def stopped_at_step_4(run_dir):
        trainer = Trainer(cfg, run_dir, quiet=True)
        for _ in range(4):  # block 1 has read one of its three windows
            trainer.train_step()
            trainer.step += 1
        trainer.save()
        return list_checkpoints(run_dir)[-1]

    checkpoint = stopped_at_step_4(tmp_path / "split")
    assert (checkpoint / CARRIED_FILE).is_file()
    resumed = Trainer(cfg, tmp_path / "split", quiet=True)
    assert resumed.resume() and resumed.step == 4 and resumed.carried is not None
    resumed.run()
    (stopped_at_step_4(tmp_path / "lost") / CARRIED_FILE).unlink()
    lost = Trainer(cfg, tmp_path / "lost", quiet=True)
    assert lost.resume() and lost.carried is None
    lost.run()
    ours, split, other = (weights(tmp_path / name) for name in ("straight", "split", "lost"))
    assert all(torch.equal(ours[k], split[k]) for k in ours)
    assert not all(torch.equal(ours[k], other[k]) for k in ours)


def test_one_window_draws_the_batches_of_a_run_without_carrying(tiny_config, tmp_path):
    """carry_windows=1 (the default) is the run it always was: the same draws, no state kept between steps."""
    cfg = load_train_config(tiny_config, LM)
    trainer = Trainer(cfg, tmp_path / "run", quiet=True)
    for step in range(2):
        trainer.step = step
        (batch,) = trainer.step_batches()
        drawn = sample_rows(trainer.task, range(cfg.batch_size), cfg.task.train_length, TRAIN_STREAM, cfg.seed, step)
        assert torch.equal(batch.inputs, drawn.inputs) and torch.equal(batch.targets, drawn.targets)
        trainer.train_step()
        assert trainer.carried is None


def test_carrying_needs_a_target_per_position(tiny_config, tmp_path):
    root = Path(__file__).resolve().parents[1] / "data" / "ucr"
    cfg = load_train_config(tiny_config, [f"task={{name: ucr, options: {{dataset: Toy, root: {root}}}, "
                                          "train_length: 12, eval_lengths: [12]}", "carry_windows=2"])
    with pytest.raises(ValueError, match=r"carry_windows \(2\) needs a task with a target per position"):
        Trainer(cfg, tmp_path / "run", quiet=True)
    assert not (tmp_path / "run").exists()
