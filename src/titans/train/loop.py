"""The training loop: AdamW, warmup + cosine, clipping, accumulation, DDP, checkpoints, JSONL metrics.

Determinism: the data of step s, micro-step m is drawn from a generator seeded by (seed, s, m), as one
global batch that every rank slices, so a resumed run sees exactly the data an uninterrupted one would,
and N ranks see exactly the global batch one rank would. The loss is a sum over scored positions
divided by the global count (times the world size, which DDP's gradient averaging divides back out),
so the gradient equals the single-process gradient of the global batch.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from ..models import ForecastHead, TitansEncoder, TitansLM
from ..tasks import IGNORE_INDEX, Task, TokenBatch, bits_per_byte, exact_match, get_task, token_accuracy
from .checkpoint import latest_checkpoint, load_trainer_state, load_weights, save_checkpoint
from .config import OptimConfig, TrainConfig


def build_task(cfg: TrainConfig) -> Task:
    return get_task(cfg.task.name, **cfg.task.options)


def build_model(cfg: TrainConfig, task: Task) -> nn.Module:
    if task.vocab_size is not None:
        if cfg.model.vocab_size < task.vocab_size:
            raise ValueError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than task {task.name}'s "
                             f"vocabulary ({task.vocab_size})")
        return TitansLM(cfg.model)
    return ForecastHead(TitansEncoder(embed_dim=task.num_features, config=cfg.model))


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Linear warmup to optim.lr, then cosine to optim.lr * min_lr_ratio at total_steps."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - optim.warmup_steps))
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW; no weight decay on vectors (norm weights, biases, gates' biases) or embeddings."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.dim() < 2 or "embed" in name else decay).append(p)
    groups = [{"params": decay, "weight_decay": optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas)


def batch_generator(seed: int, step: int, micro: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash((seed, step, micro)) % (2**63))


def loss_terms(model: nn.Module, batch, device) -> tuple[Tensor, Tensor, Tensor]:
    """(sum of per-position losses over scored positions, number of scored positions, model outputs)."""
    inputs, targets = batch.inputs.to(device), batch.targets.to(device)
    outputs, _ = model(inputs)
    if isinstance(batch, TokenBatch):
        total = F.cross_entropy(outputs.flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX,
                                reduction="sum")
        return total, (targets != IGNORE_INDEX).sum(), outputs
    return F.mse_loss(outputs.float(), targets, reduction="sum"), torch.tensor(targets.numel()), outputs


@torch.no_grad()
def evaluate(model: nn.Module, task: Task, lengths: list[int], batches: int, batch_size: int, seed: int,
             device="cpu") -> dict[int, dict[str, float]]:
    """Per length: loss (and exact-match / token accuracy, or bits per byte) on a fixed seeded set."""
    was_training = model.training
    model.eval()
    results = {}
    for length in lengths:
        total, count, matches, rows, token_right = 0.0, 0, 0.0, 0, 0.0
        for b in range(batches):
            batch = task.sample(batch_size, length, torch.Generator().manual_seed(10_000_019 * (seed + 1) + b))
            loss_sum, n, logits = loss_terms(model, batch, device)
            total, count = total + loss_sum.item(), count + int(n)
            if isinstance(batch, TokenBatch):
                matches += exact_match(logits, batch.targets.to(device)).sum().item()
                token_right += token_accuracy(logits, batch.targets.to(device)).item() * int(n)
                rows += batch.inputs.shape[0]
        metrics = {"loss": total / max(count, 1)}
        if rows:
            metrics["accuracy"] = matches / rows
            metrics["token_accuracy"] = token_right / max(count, 1)
            if task.name == "lm_bytes":
                metrics["bits_per_byte"] = bits_per_byte(metrics["loss"])
        results[length] = metrics
    model.train(was_training)
    return results


@dataclass
class TrainResult:
    step: int
    final_loss: float
    evaluation: dict[int, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


class Trainer:
    """Runs one TrainConfig into `run_dir` (metrics.jsonl, checkpoints/, final eval.json)."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, quiet: bool = False):
        self.cfg, self.run_dir, self.quiet = cfg, Path(run_dir), quiet
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if cfg.batch_size % (self.world * cfg.optim.grad_accum):
            raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by world size ({self.world}) "
                             f"x grad_accum ({cfg.optim.grad_accum})")
        if cfg.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(cfg.device)
        torch.manual_seed(cfg.seed)
        self.task = build_task(cfg)
        self.model = build_model(cfg, self.task).to(self.device)
        self.train_model: nn.Module = self.model
        if self.distributed:
            self.train_model = nn.parallel.DistributedDataParallel(self.model)
        self.optimizer = make_optimizer(self.model, cfg.optim)
        self.step = 0
        self.train_seconds = 0.0
        self.skipped_steps = 0

    # --------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "optimizer": self.optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                "train_seconds": self.train_seconds, "skipped_steps": self.skipped_steps}

    def save(self) -> None:
        if self.rank == 0:
            save_checkpoint(self.run_dir, self.step, self.model, self.state_dict(), self.cfg)
        if self.distributed:
            dist.barrier()

    def resume(self) -> bool:
        path = latest_checkpoint(self.run_dir)
        if path is None:
            return False
        load_weights(path, self.model)
        state = load_trainer_state(path)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        self.step, self.train_seconds = state["step"], state.get("train_seconds", 0.0)
        self.skipped_steps = state.get("skipped_steps", 0)
        self._truncate_metrics()
        return True

    def _truncate_metrics(self) -> None:
        """Drop metric lines written after the checkpoint we resume from (they will be written again)."""
        path = self.run_dir / "metrics.jsonl"
        if self.rank or not path.is_file():
            return
        kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= self.step]
        path.write_text("".join(line + "\n" for line in kept))

    def log(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    # ---------------------------------------------------------------------------------------- loop
    def train_step(self) -> float:
        cfg = self.cfg
        accum = cfg.optim.grad_accum
        micro_size = cfg.batch_size // accum
        per_rank = micro_size // self.world
        lr = lr_at(self.step, cfg.optim, cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.task.sample(micro_size, cfg.task.train_length, batch_generator(cfg.seed, self.step, m))
                   for m in range(accum)]
        global_count = sum(int(self._count(b)) for b in batches)
        self.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for m, batch in enumerate(batches):
            local = type(batch)(*(t[self.rank * per_rank : (self.rank + 1) * per_rank] for t in batch))
            loss_sum, _, _ = loss_terms(self.train_model, local, self.device)
            (loss_sum * self.world / global_count).backward()
            total += loss_sum.item()
        if self.distributed:
            summed = torch.tensor([total], dtype=torch.float64)
            dist.all_reduce(summed)
            total = summed.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip or float("inf"))
        if torch.isfinite(grad_norm):
            self.optimizer.step()
        else:
            # A rare overflow in the backward pass through the inner recurrence: skip this update (as
            # mixed-precision training does) instead of writing NaN into the weights; it is logged.
            self.skipped_steps += 1
        self.last_grad_norm = float(grad_norm)
        self.last_lr = lr
        return total / global_count

    @staticmethod
    def _count(batch) -> int:
        if isinstance(batch, TokenBatch):
            return int((batch.targets != IGNORE_INDEX).sum())
        return batch.targets.numel()

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.model.train()
        bar = tqdm(total=cfg.steps, initial=self.step, disable=self.quiet or self.rank != 0, desc=cfg.run_name,
                   dynamic_ncols=True, leave=False)
        loss = float("nan")
        tokens_per_step = cfg.batch_size * cfg.task.train_length
        while self.step < cfg.steps:
            start = time.perf_counter()
            loss = self.train_step()
            if not math.isfinite(loss):
                raise ValueError(f"training diverged at step {self.step} (loss {loss}); lower optim.lr or model.max_lr")
            elapsed = time.perf_counter() - start
            self.train_seconds += elapsed
            self.step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.4f}")
            if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                self.log({"step": self.step, "loss": loss, "lr": self.last_lr, "grad_norm": self.last_grad_norm,
                          "skipped_steps": self.skipped_steps,
                          "tokens_per_s": tokens_per_step / elapsed})
            if cfg.eval_every and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                self.log({"step": self.step, "eval": self._evaluate([cfg.task.train_length])})
            out_of_time = cfg.time_budget_s is not None and self.train_seconds >= cfg.time_budget_s
            if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or out_of_time:
                self.save()
            if out_of_time:
                break
        bar.close()
        self.save()
        evaluation = self._evaluate(cfg.task.eval_lengths)
        self.log({"step": self.step, "eval": evaluation})
        if self.rank == 0:
            (self.run_dir / "eval.json").write_text(json.dumps(
                {"name": cfg.run_name, "task": cfg.task.name, "train_length": cfg.task.train_length,
                 "step": self.step, "train_seconds": self.train_seconds,
                 "num_parameters": sum(p.numel() for p in self.model.parameters()),
                 "results": {str(k): v for k, v in evaluation.items()}}, indent=2))
        return TrainResult(self.step, loss, evaluation, self.train_seconds)

    def _evaluate(self, lengths: list[int]) -> dict[int, dict[str, float]]:
        per_batch = max(1, min(self.cfg.batch_size, 16))
        return evaluate(self.model, self.task, lengths, self.cfg.eval_batches, per_batch, self.cfg.seed, self.device)


def setup_distributed() -> bool:
    """Initialise torch.distributed from torchrun's environment (gloo on CPU, nccl on GPU)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or dist.is_initialized():
        return dist.is_available() and dist.is_initialized()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, quiet: bool = False) -> TrainResult:
    trainer = Trainer(cfg, run_dir, quiet=quiet)
    if resume:
        trainer.resume()
    return trainer.run()
