"""Sharded training (parallel=fsdp, FSDP2) and activation checkpointing, on the CPU: two gloo ranks lose what one
process loses and end with its weights, their checkpoint is sharded and resumes bit-exact, exports to one pretrained
directory, and bf16 mixed precision keeps the memory's state float32; recomputing blocks changes no gradient."""

import os
import shutil
from pathlib import Path

import pytest
import torch

from titans import TitansLM
from titans.train import build_model, build_task, load_train_config, train
from titans.train.checkpoint import latest_checkpoint, load_weights
from titans.train.export import export_checkpoint
from titans.train.fsdp import shard_model
from titans.train.precision import autocast

MAC = ["model.variant=mac", "model.segment_len=8", "model.depth=2"]
# carry_windows=4: the step-2 checkpoint holds each rank's carried states, which the resume must read back
COMMON = [*MAC, "dtype=float64", "steps=4", "batch_size=8", "optim.grad_accum=2", "checkpoint_every=2",
          "carry_windows=4"]


def _rank(rank: int, port: int, config: str, root: str, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    torch.distributed.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        sharded = COMMON + ["parallel=fsdp", "activation_checkpointing=true"]
        full = train(load_train_config(config, sharded), Path(root) / "full", quiet=True)
        # the run as a kill after its step-2 checkpoint would leave it, resumed to step 4
        if rank == 0:
            shutil.copytree(Path(root) / "full", Path(root) / "resumed")
            shutil.rmtree(latest_checkpoint(Path(root) / "resumed"))
            (Path(root) / "resumed" / "eval.json").unlink()
        torch.distributed.barrier()
        resumed = train(load_train_config(config, sharded), Path(root) / "resumed", resume=True, quiet=True)
        cfg = load_train_config(config, [*MAC, "steps=2", "batch_size=4", "parallel=fsdp", "dtype=bfloat16",
                                         "checkpoint_every=0"])
        mixed = train(cfg, Path(root) / "bf16", quiet=True)
        # bf16 mixed precision: the blocks compute in bf16, the memory's state stays float32
        model = TitansLM(cfg.model)
        shard_model(model, "bfloat16")
        with autocast("bfloat16", "cpu"):
            logits, state = model(torch.randint(0, cfg.model.vocab_size, (1, 12)))
        dtypes = (logits.dtype, state[0].memory.weights[0].dtype, state[0].memory.momentum[0].dtype)
        queue.put((rank, full.final_loss, full.evaluation, resumed.final_loss, mixed.final_loss, dtypes))
    finally:
        torch.distributed.destroy_process_group()


def test_two_sharded_ranks_match_one_process_and_resume_exactly(tiny_config, tmp_path, two_ranks):
    single = train(load_train_config(tiny_config, COMMON), tmp_path / "single", quiet=True)
    results = two_ranks(_rank, str(tiny_config), str(tmp_path))
    (loss0, eval0, resumed0, mixed0, dtypes), (loss1, eval1, resumed1, mixed1, _) = results[0], results[1]
    assert loss0 == loss1 == pytest.approx(single.final_loss, rel=1e-12)  # the global batch's loss on every rank
    assert eval1 == {} and eval0[24] == pytest.approx(single.evaluation[24], rel=1e-9)
    assert resumed0 == loss0 and resumed1 == loss1  # resumed from the sharded checkpoint: the same last step
    assert torch.isfinite(torch.tensor([mixed0, mixed1])).all()
    assert dtypes == (torch.bfloat16, torch.float32, torch.float32)

    checkpoint = latest_checkpoint(tmp_path / "full")
    assert (checkpoint / "sharded" / ".metadata").is_file() and not (checkpoint / "model.safetensors").exists()
    cfg = load_train_config(tiny_config, COMMON)
    models = {}
    for name in ("single", "full", "resumed"):
        models[name] = build_model(cfg, build_task(cfg)).double()
        load_weights(latest_checkpoint(tmp_path / name), models[name])  # the shards gathered in one process
    full, resumed, one = (dict(models[n].state_dict()) for n in ("full", "resumed", "single"))
    assert all(torch.equal(full[k], resumed[k]) for k in full)  # bit-exact after the resume
    assert max((full[k] - one[k]).abs().max().item() for k in full) < 1e-12
    exported = export_checkpoint(tmp_path / "full", tmp_path / "exported")
    loaded = TitansLM.from_pretrained(exported).state_dict()
    assert all(torch.equal(loaded[k], full[k]) for k in full)


@pytest.mark.parametrize("variant", ["mac", "mag", "mal", "lmm", "transformer", "gated_deltanet"])
def test_activation_checkpointing_changes_no_gradient(tiny_config, variant):
    cfg = load_train_config(tiny_config, [f"model.variant={variant}", "model.segment_len=8", "model.window=8",
                                          "model.depth=2"])
    torch.manual_seed(0)
    model = build_model(cfg, build_task(cfg)).double().train()
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 24))
    grads, counts = [], []
    for recompute in (False, True):
        model.zero_grad()
        model.backbone.checkpoint_blocks = recompute
        logits, _ = model(tokens)
        logits.square().mean().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        counts.append([m.momentum_bound_record() for m in model.modules() if hasattr(m, "momentum_bound_record")])
    assert grads[0].keys() == grads[1].keys() and grads[0]
    assert all(torch.allclose(grads[0][n], grads[1][n], rtol=1e-10, atol=1e-13) for n in grads[0])
    if counts[0]:  # the recomputation counted nothing twice: the second pass added what the first did
        assert all(b[1] == 2 * a[1] for a, b in zip(counts[0], counts[1]))
