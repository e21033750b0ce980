"""Each variant learns: a tiny needle (passkey) task, loss far below chance within 200 CPU steps."""

import math

import pytest

from titans.models import VARIANTS
from titans.train import load_train_config, train


@pytest.mark.slow
@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_learns_the_passkey_task(variant, tmp_path):
    data = {
        "model": {"variant": variant, "dim": 32, "depth": 1, "heads": 2, "window": 32, "segment_len": 16,
                  "chunk_size": 4, "n_persistent": 2, "max_lr": 0.02},
        "task": {"name": "passkey", "options": {"vocab": 16, "num_values": 8}, "train_length": 24,
                 "eval_lengths": [24]},
        "optim": {"lr": 0.003, "warmup_steps": 10, "weight_decay": 0.0},
        "steps": 200, "batch_size": 32, "eval_batches": 2, "checkpoint_every": 0, "log_every": 1000,
    }
    result = train(load_train_config(data=data), tmp_path / variant, quiet=True)
    chance = math.log(8)  # uniform over the 8 value tokens
    assert result.evaluation[24]["loss"] < 0.25 * chance
    assert result.evaluation[24]["accuracy"] >= 0.9
