"""DDP: two gloo ranks end with the weights and loss of one process on the same global batch."""

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from titans.train import load_train_config, train
from titans.train.checkpoint import latest_checkpoint

# float64 so that the only difference between 1 and 2 ranks, the order of the gradient sums, stays at 1e-16
COMMON = ["dtype=float64", "steps=4", "batch_size=8", "checkpoint_every=0"]


def _rank(rank: int, port: int, config: str, overrides: list[str], run_dir: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    try:
        result = train(load_train_config(config, overrides), Path(run_dir) / "full", quiet=True)
        # rank 1 runs out of time after its first step, rank 0 never would: both must stop there together
        budget = "1.0e-9" if rank == 1 else "1.0e9"
        timed = train(load_train_config(config, overrides + [f"time_budget_s={budget}", "steps=50"]),
                      Path(run_dir) / "timed", quiet=True)
        queue.put((rank, result.final_loss, result.evaluation, timed.step))
    finally:
        torch.distributed.destroy_process_group()


def test_two_ranks_match_one_rank(tiny_config, tmp_path, two_ranks):
    single = train(load_train_config(tiny_config, COMMON), tmp_path / "single", quiet=True)
    # accumulation on top: each rank runs 2 micro-batches of 2 rows, the gradient is all-reduced once
    overrides = COMMON + ["optim.grad_accum=2"]
    results = two_ranks(_rank, str(tiny_config), overrides, str(tmp_path / "ddp"), timeout=240)
    assert results[0][0] == results[1][0]  # every rank reports the loss of the global batch
    assert results[0][0] == pytest.approx(single.final_loss, rel=1e-12)
    assert results[1][1] == {} and results[0][1][24] == pytest.approx(single.evaluation[24], rel=1e-9)
    assert results[0][2] == results[1][2] == 1
    one = load_file(str(latest_checkpoint(tmp_path / "single") / "model.safetensors"))
    two = load_file(str(latest_checkpoint(tmp_path / "ddp" / "full") / "model.safetensors"))  # written by rank 0
    assert one.keys() == two.keys()
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-12
