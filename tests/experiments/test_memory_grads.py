"""The memory-gradient diagnostic (issue 47, "why the second block's memory trains so little"): on a MAC trained a
few steps, per block, the gradient norm of each part, the reads' RMS and the loss's gradient with respect to them."""

import json
import math

import pytest

from titans.experiments.memory_grads import main
from titans.train import train
from titans.train.config import load_train_config

pytestmark = pytest.mark.usefixtures("one_thread")


def test_a_trained_mac_gets_its_memory_gradients_per_block_in_json(tmp_path):
    cfg = load_train_config(data={
        "model": {"variant": "mac", "dim": 16, "depth": 2, "heads": 1, "segment_len": 16},
        "task": {"name": "niah_passkey", "options": {"digits": 2}, "train_length": 128, "eval_lengths": [128]},
        "steps": 2, "batch_size": 2, "eval_batches": 1, "eval_batch_size": 2, "tensorboard": False})
    train(cfg, tmp_path / "run", quiet=True)
    out = main([str(tmp_path / "run"), "--batches", "1", "--batch-size", "2", "--out", str(tmp_path / "g.json")])
    data = json.loads(out.read_text())
    assert data["variant"] == "mac" and data["step"] == 2 and len(data["blocks"]) == 2
    for block in data["blocks"]:
        norms = block["grad_norm"]
        assert {"memory (all)", "memory projection", "memory gates", "memory initial weights", "memory output",
                "mixer attention", "mlp"} <= set(norms)
        assert all(math.isfinite(v) for v in norms.values()) and norms["memory (all)"] > 0
        assert set(block["read_rms"]) == set(block["read_grad_rms"]) == {"context", "gate"}
        assert all(v > 0 for v in block["read_grad_rms"].values())
    first = data["ratio_to_first"][0]
    assert all(v == 1 for v in first["grad_norm"].values() if v is not None)
