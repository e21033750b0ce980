"""The training loop: AdamW, warmup + cosine, clipping, accumulation, DDP, checkpoints, JSONL metrics.

Determinism. Row i of the global batch of step s is drawn from its own generator, seeded by
(seed, s, i). A rank draws only its rows, so a resumed run sees exactly the data an uninterrupted
one would, and any number of ranks and accumulation steps see exactly the global batch one process
would. The loss of a step is the sum over every scored position of the global batch divided by the
global count of scored positions (each rank scales its sum by world_size / count, which DDP's
gradient averaging divides back out), so the gradient is the single-process gradient of the
global batch. Evaluation sets are drawn the same way from (length, row) and do not depend on the
training seed: every model is scored on the same sequences.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from ..models import ClassificationHead, ForecastHead, TitansEncoder, TitansLM
from ..models.config import PEER_VARIANTS
from ..models.lm import Backbone
from ..models.peer import PeerMAC, check_streaming, implementation_record
from ..tasks import Task, get_task
from ..tasks.base import Batch
from .batches import (
    DROPOUT_STREAM,
    TRAIN_STREAM,
    carried_loss_terms,
    derive_seed,
    loss_terms,
    sample_rows,
    scored_positions,
    to_device,
)
from .checkpoint import (
    SHARDED_DIR,
    check_run_dir,
    latest_checkpoint,
    load_carried,
    load_checkpoint_config,
    load_trainer_state,
    load_weights,
    prepare_run_dir,
    resolve_checkpoint,
    save_checkpoint,
)
from .config import OptimConfig, TrainConfig, check_model_fits_task, resume_mismatches
from .evaluation import EvalPlan, evaluate
from .fsdp import load_sharded, save_sharded, set_gradient_sync, shard_model
from .precision import parameter_dtype


def resolve_device(name: str, index: int = 0) -> torch.device:
    """"cpu", "cuda" (the `index`-th GPU: the local rank) or "auto" (cuda when available)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device is cuda but torch.cuda.is_available() is False; use device=cpu or auto")
        return torch.device("cuda", index % torch.cuda.device_count())
    if name != "cpu":
        raise ValueError(f"device must be cpu, cuda or auto, got {name!r}")
    return torch.device("cpu")


def build_task(cfg: TrainConfig) -> Task:
    return get_task(cfg.task.name, **cfg.task.options)


def checked_tasks(cfg: TrainConfig) -> tuple[Task, Task]:
    """The training task and its held-out split (the validation split of a task read from data), each sampled once
    at every length the run uses: an empty split, or a length a split cannot hold, fails now, before a run
    directory is touched, not after training."""
    task = build_task(cfg)
    eval_task = task.held_out()
    if cfg.eval_position_buckets and task.vocab_size is None:
        raise ValueError(f"eval_position_buckets is for token tasks; {task.name} is not one")
    task.sample(1, cfg.task.train_length, torch.Generator().manual_seed(0))
    for length in sorted({cfg.task.train_length, *cfg.task.eval_lengths}):
        eval_task.sample(1, length, torch.Generator().manual_seed(0))
    return task, eval_task


def build_model(cfg: TrainConfig, task: Task) -> nn.Module:
    """A TitansLM for token tasks; a TitansEncoder with a next-step forecasting head for series tasks, or with a
    linear classifier of its last hidden state for classification tasks."""
    check_model_fits_task(cfg.model, task)
    if cfg.model.variant in PEER_VARIANTS:  # another implementation's model: token tasks, whole sequences only
        if task.vocab_size is None:
            raise ValueError(f"variant {cfg.model.variant} is a language model; task {task.name} is not a token task")
        check_streaming(cfg.eval_piece, cfg.carry_windows)
        return PeerMAC(cfg.model)
    if task.vocab_size is not None:
        return TitansLM(cfg.model)
    encoder = TitansEncoder(embed_dim=task.num_features, config=cfg.model)
    if task.num_classes is not None:
        return ClassificationHead(encoder, task.num_classes)
    return ForecastHead(encoder)


def check_shardable(cfg: TrainConfig, model: nn.Module, distributed: bool) -> None:
    """What `parallel: fsdp` needs: a process group (torchrun), a language model, no torch.compile (not tried)."""
    if not distributed:
        raise ValueError("parallel=fsdp shards the model over the ranks of a process group: run under torchrun "
                         "(torchrun --nproc_per_node N -m titans.cli train ...; N may be 1)")
    if not isinstance(model, TitansLM):
        raise ValueError(f"parallel=fsdp shards language models (TitansLM); task {cfg.task.name} trains a "
                         f"{type(model).__name__}")
    if cfg.compile:
        raise ValueError("parallel=fsdp does not combine with compile=true yet (untested); drop one of them")


def load_trained(ckpt: Path, device: str = "cpu") -> tuple[Path, TrainConfig, Task, nn.Module]:
    """(checkpoint path, config, task, model in eval mode on `device`) of a checkpoint, or of a run directory's
    latest."""
    path = resolve_checkpoint(ckpt)
    cfg = load_checkpoint_config(path)
    task = build_task(cfg)
    model = build_model(cfg, task).to(parameter_dtype(cfg.dtype))
    load_weights(path, model)
    return path, cfg, task, model.to(resolve_device(device)).eval()


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate of (0-based) `step`: linear warmup to optim.lr over warmup_steps, then cosine
    decay that reaches lr * min_lr_ratio at the last step, total_steps - 1."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    progress = min(1.0, (step - optim.warmup_steps) / max(1, total_steps - 1 - optim.warmup_steps))
    floor = optim.lr * optim.min_lr_ratio
    return floor + (optim.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(model: nn.Module, optim: OptimConfig, fused: bool = False) -> torch.optim.AdamW:
    """AdamW; weight decay only on the matrices of nn.Linear and nn.LSTM layers. `fused`: torch's fused kernel, which
    also takes the skip decision on the device (`optimizer.found_inf`, `Trainer.train_step`).

    No decay on norms, biases, embeddings (also when tied to the output layer), persistent tokens,
    conv kernels or the memory's initial weights W_0: the last is a learned starting state that the
    inner loop already decays through its forgetting gate α. With `optim.decay_gates` false, none on the projection
    of the memory's gates either (`NeuralMemory.to_gates`).
    """
    from ..memory import NeuralMemory

    embedding_ids = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()}
    gate_ids = set() if optim.decay_gates else {
        id(p) for m in model.modules() if isinstance(m, NeuralMemory) and m.to_gates is not None
        for p in m.to_gates.parameters()}
    decay_ids = {id(p) for m in model.modules() if isinstance(m, (nn.Linear, nn.LSTM))
                 for p in m.parameters(recurse=False) if p.dim() >= 2 and id(p) not in embedding_ids | gate_ids}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if id(p) in decay_ids], "weight_decay": optim.weight_decay},
              {"params": [p for p in params if id(p) not in decay_ids], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=optim.betas, eps=optim.eps, fused=fused)


def tensorboard_writer(path: Path) -> Any | None:
    """A TensorBoard SummaryWriter, or None when the tensorboard package is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(path))


class MetricsLog:
    """Appends records to run_dir/metrics.jsonl, and their numbers to TensorBoard when it is installed."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        # The writer creates its folder: it is made with the first record, so that building a trainer writes
        # nothing into a run directory that may still be refused.
        self.tensorboard_dir = Path(run_dir) / "tensorboard" if tensorboard else None
        self.writer: Any | None = None

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.tensorboard_dir is not None:
            self.writer, self.tensorboard_dir = tensorboard_writer(self.tensorboard_dir), None
        if self.writer is not None:
            for key, value in _scalars(record):
                self.writer.add_scalar(key, value, record["step"])

    def truncate(self, step: int) -> None:
        """Drop the records a resumed run will write again: those after `step`, and the final evaluation."""
        if not self.path.is_file():
            return
        lines = [line for line in self.path.read_text().splitlines() if line.strip()]
        records = []
        for i, line in enumerate(lines):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if i < len(lines) - 1:
                    raise ValueError(f"{self.path}: line {i + 1} is not JSON") from None
                continue  # the last line was cut off by a kill mid-write: its step is redone after the checkpoint
            if not (isinstance(record, dict) and type(record.get("step")) is int):
                raise ValueError(f"{self.path}: line {i + 1} is not a metrics record (a mapping with an integer step)")
            records.append(record)
        kept = [r for r in records if r["step"] <= step and not r.get("final")]
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
        os.replace(tmp, self.path)  # atomic: a kill now leaves the old log or the new one, never half of it

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _scalars(record: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    out = []
    for key, value in record.items():
        if isinstance(value, dict):
            out += _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            out.append((f"{prefix}{key}", float(value)))
    return out


@dataclass
class StepRead:
    """A training step's numbers as read back from the device: the loss and gradient norm, and whether its update was
    applied (both finite)."""

    step: int  # 1-based: the step count once it ran
    loss: float
    lr: float
    grad_norm: float

    @property
    def applied(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


@dataclass
class TrainResult:
    step: int
    final_loss: float  # training loss of the last step
    evaluation: dict[int, dict[str, Any]] = field(default_factory=dict)  # empty on ranks other than 0
    seconds: float = 0.0  # training time, evaluation excluded
    num_parameters: int = 0
    skipped_steps: int = 0  # updates skipped for a non-finite loss or gradient
    peak_grad: tuple[float, int] = (0.0, 0)  # the largest outer gradient norm before clipping, and its step
    momentum_bound: tuple[int, int] = (0, 0)  # (learned θ_t lowered by κ, learned θ_t bounded) in training


def momentum_bound_record(model: nn.Module) -> tuple[int, int]:
    """(learned θ_t lowered by the bound on the momentum's gain, learned θ_t it bounded) over the training forwards
    of `model`'s memories so far (`NeuralMemory.momentum_bound_record`; one host read per memory)."""
    from ..memory import NeuralMemory

    records = [m.momentum_bound_record() for m in model.modules() if isinstance(m, NeuralMemory)]
    return sum(r[0] for r in records), sum(r[1] for r in records)


def bound_share(record: tuple[int, int]) -> float | None:
    """The share of learned θ_t that κ lowered; None where no θ_t was bounded (no memory, or κ off)."""
    return record[0] / record[1] if record[1] else None


class Trainer:
    """Runs one TrainConfig into `run_dir` (config.yaml, metrics.jsonl, checkpoints/, eval.json).

    Under torch.distributed (torchrun) the model is wrapped in DistributedDataParallel, each rank
    takes its share of the global batch, and rank 0 alone logs, checkpoints and evaluates.

    Host syncs. On a GPU (`defer_reads`, default there) a step reads nothing back: its loss and gradient norm stay on
    the device until the next log line, evaluation or checkpoint reads every step since in one sync, and a step whose
    loss or gradient is not finite is skipped on the device by the fused AdamW (`found_inf`, the flag mixed-precision
    loss scaling uses). Skips are counted, logged and checked against `max_skips_in_row` when they are read, in step
    order, so the records are those of a run that reads every step; only the error for too many skips in a row may
    come up to `log_every` steps late; `train_seconds` (and the time budget's check) lags, between reads, by the work
    still queued on the device. On the CPU a read costs nothing and every step is read at once.
    """

    def __init__(self, cfg: TrainConfig, run_dir: Path, quiet: bool = False, defer_reads: bool | None = None,
                 bar_position: int | None = None):
        self.cfg, self.run_dir, self.quiet, self.bar_position = cfg, Path(run_dir), quiet, bar_position
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        self.world = dist.get_world_size() if self.distributed else 1
        if cfg.batch_size % (self.world * cfg.optim.grad_accum):
            raise ValueError(f"batch_size ({cfg.batch_size}) must be divisible by the world size ({self.world}) "
                             f"x optim.grad_accum ({cfg.optim.grad_accum})")
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.device = resolve_device(cfg.device, int(os.environ.get("LOCAL_RANK", self.rank)))
        torch.manual_seed(cfg.seed)
        self.task, self.eval_task = checked_tasks(cfg)
        self.model = build_model(cfg, self.task).to(self.device, parameter_dtype(cfg.dtype))
        if cfg.carry_windows > 1 and isinstance(self.model, ClassificationHead):
            raise ValueError(f"carry_windows ({cfg.carry_windows}) needs a task with a target per position; "
                             f"{cfg.task.name} classifies whole series")
        self.sharded = cfg.parallel == "fsdp"
        if self.sharded:
            check_shardable(cfg, self.model, self.distributed)
        if cfg.activation_checkpointing:
            if not isinstance(getattr(self.model, "backbone", None), Backbone):
                raise ValueError("activation_checkpointing recomputes the blocks of a model's backbone; "
                                 f"{type(self.model).__name__} has none")
            self.model.backbone.checkpoint_blocks = True
        self.train_model: nn.Module = self.model
        if self.sharded:
            shard_model(self.model, cfg.dtype)  # in place: the model is its own training module
        elif self.distributed:
            device_ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_model = nn.parallel.DistributedDataParallel(self.model, device_ids=device_ids)
        if cfg.compile:  # the training forward only: evaluation reads other lengths (each a recompile) and no grads
            self.train_model = torch.compile(self.train_model)
        self.defer_reads = self.device.type == "cuda" if defer_reads is None else defer_reads
        self.optimizer = make_optimizer(self.model, cfg.optim, fused=self.defer_reads)
        self.unread: list[tuple[int, float, Tensor]] = []  # (step, lr, [loss, grad norm] on the device) not yet read
        self.last_read: StepRead | None = None  # the newest step read
        self.step = 0
        self.train_seconds = 0.0
        self.skipped_steps = 0  # optimiser steps skipped for a non-finite loss or gradient, in all
        self.skips_in_row = 0  # ... and since the last step taken
        # The largest finite gradient norm before clipping, and its step: clipping bounds the update a gradient spike
        # makes, so without this a run whose gradient exploded for a while would look like any other.
        self.peak_grad: tuple[float, int] = (0.0, 0)
        # κ's record before this process (a resumed run's, from its checkpoint); the memories count the rest
        self.earlier_bound: tuple[int, int] = (0, 0)
        self.saved_step: int | None = None
        # carry_windows: the states the next step's micro-batches start from (None: fresh), and the sequences of the
        # current block of windows (block index, one batch per micro-batch)
        self.carried: list[Any] | None = None
        self.block: tuple[int, list[Batch]] | None = None
        self.metrics = MetricsLog(self.run_dir, cfg.tensorboard) if self.rank == 0 else None

    # --------------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        # a sharded run's optimiser state is in its shards (`save_sharded`), not here
        return {"step": self.step, "optimizer": {} if self.sharded else self.optimizer.state_dict(),
                "rng": {"cpu": torch.get_rng_state(), "cuda": cuda_rng},
                "train_seconds": self.train_seconds, "skipped_steps": self.skipped_steps,
                "skips_in_row": self.skips_in_row, "peak_grad": list(self.peak_grad),
                "momentum_bound": list(self.momentum_bound())}

    def momentum_bound(self) -> tuple[int, int]:
        """κ's record over the whole run: (learned θ_t it lowered, learned θ_t it bounded)."""
        now = momentum_bound_record(self.model)
        return self.earlier_bound[0] + now[0], self.earlier_bound[1] + now[1]

    def save(self) -> None:
        """Checkpoint the current step (every rank takes part: its carried states, its shards; once per step)."""
        if self.saved_step == self.step:
            return
        self.read_steps()  # the skip counters go into the checkpoint
        shards = (lambda folder: save_sharded(self.model, self.optimizer, folder)) if self.sharded else None
        save_checkpoint(self.run_dir, self.step, self.model, self.state_dict(), self.cfg,
                        keep=self.cfg.keep_checkpoints, carried=self.carried, rank=self.rank, world=self.world,
                        write_shards=shards)
        self.saved_step = self.step

    def resume(self) -> bool:
        """Continue from the run directory's latest checkpoint; False (start at step 0) when it has none."""
        path = latest_checkpoint(self.run_dir)
        # The config resumes the checkpoint's or, in a run stopped before its first checkpoint, the run's own.
        saved = path if path is not None else self.run_dir
        if path is not None or (saved / "config.yaml").is_file():
            mismatches = resume_mismatches(load_checkpoint_config(saved), self.cfg)
            if mismatches:
                raise ValueError(f"--resume: the config differs from {saved / 'config.yaml'} in "
                                 f"{', '.join(mismatches)}")
        if path is None:
            if self.metrics is not None:
                self.metrics.truncate(0)
            return False
        state = load_trainer_state(path)
        if self.sharded:
            if not (path / SHARDED_DIR).is_dir():
                raise ValueError(f"--resume: checkpoint {path} is not sharded (parallel: fsdp writes sharded ones)")
            load_sharded(self.model, self.optimizer, path / SHARDED_DIR)
        else:
            load_weights(path, self.model)
            try:
                self.optimizer.load_state_dict(state["optimizer"])
            except (ValueError, KeyError, RuntimeError) as err:
                raise ValueError(f"checkpoint {path}: optimizer state does not match the model: {err}") from None
        torch.set_rng_state(state["rng"]["cpu"])
        if state["rng"]["cuda"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.step, self.train_seconds = state["step"], state["train_seconds"]
        self.skipped_steps = state["skipped_steps"]
        self.skips_in_row = state.get("skips_in_row", 0)  # absent from checkpoints written before it was kept
        self.peak_grad = tuple(state.get("peak_grad", (0.0, 0)))  # likewise
        self.earlier_bound = tuple(state.get("momentum_bound", (0, 0)))  # likewise (unknown before it: counted as 0)
        self.carried = load_carried(path, self.device, self.rank, self.world)
        self.saved_step = self.step
        if self.metrics is not None:
            self.metrics.truncate(self.step)
        return True

    # ---------------------------------------------------------------------------------------- loop
    def train_step(self) -> None:
        """One optimiser step on the global batch of `self.step`, skipped when its loss or gradient is not finite;
        its numbers go to `unread` (read at once unless `defer_reads`)."""
        cfg = self.cfg
        accum = cfg.optim.grad_accum
        lr = lr_at(self.step, cfg.optim, cfg.steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Dropout masks from (seed, step, rank): each DDP rank draws its own, and a step's masks do not depend on
        # what ran before it (a resumed or re-run step draws the same ones).
        torch.manual_seed(derive_seed(DROPOUT_STREAM, cfg.seed, self.step, self.rank))
        batches = self.step_batches()
        global_count = to_device(torch.tensor(float(sum(scored_positions(b) for b in batches))), self.device)
        if self.distributed:
            dist.all_reduce(global_count)
        scale = self.world / global_count.clamp_min(1)
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        ends: list[Any] = [None] * accum
        for m, batch in enumerate(batches):
            # gradients are all-reduced (or reduce-scattered) once, after the last micro-batch
            syncing = not self.distributed or m == accum - 1
            if self.sharded:
                set_gradient_sync(self.model, syncing)
            with contextlib.nullcontext() if syncing or self.sharded else self.train_model.no_sync():
                if cfg.carry_windows == 1:
                    batch_loss, _ = loss_terms(self.train_model, batch, self.device, precision=cfg.dtype)
                else:
                    batch_loss, ends[m] = carried_loss_terms(self.train_model, batch, self.device,
                                                             self.carried[m] if self.carried else None, cfg.dtype)
                (batch_loss * scale).backward()
            loss_sum += batch_loss.detach()
        if self.distributed:
            dist.all_reduce(loss_sum)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip or math.inf)
        if isinstance(grad_norm, DTensor):  # sharded gradients: the norm of the whole gradient, on every rank
            grad_norm = grad_norm.full_tensor()
        loss = loss_sum / global_count.clamp_min(1)
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if self.defer_reads:
            # The fused AdamW leaves the weights, moments and step count as they were where found_inf is 1.
            self.optimizer.found_inf = (~finite).float()
            self.optimizer.step()
            del self.optimizer.found_inf
        elif finite.item():
            self.optimizer.step()
        self.unread.append((self.step + 1, lr, torch.stack([loss, grad_norm.to(loss.dtype)]).detach()))
        # The next step reads on from where this one ended, unless it starts a new block of windows or this step was
        # skipped: the state may hold what made it non-finite (on a GPU the check is a host sync, in carried runs only).
        reads_on = (self.step + 1) % cfg.carry_windows != 0
        self.carried = ends if reads_on and bool(finite) else None
        if not self.defer_reads:
            self.read_steps()

    def step_batches(self) -> list[Batch]:
        """This rank's micro-batches of the current step. Row i of a step's global batch is drawn from (seed, step,
        i); with `carry_windows` = N, from (seed, block, i) at N times the training length, the step taking window
        `step % N` of block `step // N` (N = 1: the same draws as without)."""
        cfg = self.cfg
        micro_size = cfg.batch_size // cfg.optim.grad_accum
        per_rank = micro_size // self.world
        block, window = divmod(self.step, cfg.carry_windows)
        if self.block is None or self.block[0] != block:
            drawn = [sample_rows(self.task, range(first, first + per_rank), cfg.carry_windows * cfg.task.train_length,
                                 TRAIN_STREAM, cfg.seed, block)
                     for first in (m * micro_size + self.rank * per_rank for m in range(cfg.optim.grad_accum))]
            self.block = block, drawn
        if cfg.carry_windows == 1:
            return self.block[1]
        span = slice(window * cfg.task.train_length, (window + 1) * cfg.task.train_length)
        return [type(b)(*(t[:, span] for t in b)) for b in self.block[1]]

    def read_steps(self) -> list[StepRead]:
        """Read the steps not read yet (one host sync for all) and account for their skips in step order: the steps
        read, oldest first."""
        if not self.unread:
            return []
        values = torch.stack([v for _, _, v in self.unread]).tolist()
        steps = [StepRead(step, loss, lr, grad_norm) for (step, lr, _), (loss, grad_norm) in zip(self.unread, values)]
        self.unread = []
        self.last_read = steps[-1]
        for read in steps:
            if read.applied:
                self.skips_in_row = 0
                if read.grad_norm > self.peak_grad[0]:
                    self.peak_grad = (read.grad_norm, read.step)
            else:
                self._skip(read)
        return steps

    def _skip(self, read: StepRead) -> None:
        """Skip the update of a step whose loss or gradient is not finite (as mixed-precision training does with an
        overflow) instead of writing NaN into the weights: counted, logged, and fatal after
        `max_skips_in_row` in a row, when the weights themselves must have gone bad."""
        self.skipped_steps += 1
        self.skips_in_row += 1
        self._log({"step": read.step, "skipped": True, "loss": read.loss, "grad_norm": read.grad_norm,
                   "skipped_steps": self.skipped_steps, "skips_in_row": self.skips_in_row})
        if self.rank == 0:
            tqdm.write(f"{self.cfg.run_name}: step {read.step} skipped (loss {read.loss}, gradient norm "
                       f"{read.grad_norm}); {self.skips_in_row} in a row, {self.skipped_steps} in all", file=sys.stderr)
        if self.skips_in_row >= self.cfg.max_skips_in_row:
            raise ValueError(f"{self.cfg.run_name}: training diverged: {self.skips_in_row} steps in a row (up to step "
                             f"{read.step}) had a non-finite loss or gradient (max_skips_in_row="
                             f"{self.cfg.max_skips_in_row}); lower optim.lr, or check the data")

    def run(self) -> TrainResult:
        cfg = self.cfg
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0:
            cfg.to_yaml(self.run_dir / "config.yaml")
        self.model.train()
        # A positioned bar is one of several processes' bars on one terminal (the demo's): it stays when done.
        bar = tqdm(total=cfg.steps, initial=self.step, desc=cfg.run_name, dynamic_ncols=True,
                   position=self.bar_position, leave=self.bar_position is not None,
                   disable=True if self.quiet or self.rank else None)  # None: off when not a terminal
        window_start, window_steps = time.perf_counter(), 0
        while self.step < cfg.steps:
            start = time.perf_counter()
            self.train_step()
            self.step += 1
            logging = self.step % cfg.log_every == 0 or self.step == cfg.steps
            evaluating = bool(cfg.eval_every) and self.step % cfg.eval_every == 0 and self.step < cfg.steps
            saving = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
            if logging or evaluating or saving:
                # Read here, inside the timed step: the device work the read waits for is training time.
                self.read_steps()
            self.train_seconds += time.perf_counter() - start
            window_steps += 1
            bar.update(1)
            last = self.last_read
            if last is not None and last.step == self.step:
                bar.set_postfix(loss=f"{last.loss:.4f}")
            if logging:
                now = time.perf_counter()
                tokens = window_steps * cfg.batch_size * cfg.task.train_length
                self._log({"step": self.step, "loss": last.loss, "lr": last.lr, "grad_norm": last.grad_norm,
                           "tokens_per_s": tokens / (now - window_start), "skipped_steps": self.skipped_steps,
                           "train_seconds": self.train_seconds})
                window_start, window_steps = now, 0
            if evaluating:
                self._log({"step": self.step, "eval": self._evaluate([cfg.task.train_length])})
            out_of_time = self._out_of_time()
            if saving or out_of_time:
                self.save()
            if out_of_time:
                break
        bar.close()
        self.read_steps()  # a run stopped by its time budget between reads
        self.save()
        evaluation = self._evaluate(cfg.task.eval_lengths)
        num_parameters = sum(p.numel() for p in self.model.parameters())
        bound = self.momentum_bound()
        if self.rank == 0:
            self._log({"step": self.step, "final": True, "eval": evaluation})
            (self.run_dir / "eval.json").write_text(json.dumps(
                {"name": cfg.run_name, "task": cfg.task.name, "train_length": cfg.task.train_length,
                 "step": self.step, "train_seconds": self.train_seconds, "num_parameters": num_parameters,
                 "skipped_steps": self.skipped_steps, "peak_grad_norm": self.peak_grad[0],
                 "peak_grad_step": self.peak_grad[1], "momentum_bound_share": bound_share(bound),
                 **implementation_record(self.model),  # another implementation's package, version and options
                 "results": {str(k): v for k, v in evaluation.items()}}, indent=2))
            self.metrics.close()
        loss = self.last_read.loss if self.last_read is not None else math.nan  # nan: resumed with no step left
        return TrainResult(self.step, loss, evaluation, self.train_seconds, num_parameters, self.skipped_steps,
                           self.peak_grad, bound)

    def _out_of_time(self) -> bool:
        """Whether training has used up cfg.time_budget_s; under DDP as soon as any rank has (all stop together)."""
        if self.cfg.time_budget_s is None:
            return False
        spent = self.train_seconds >= self.cfg.time_budget_s
        if not self.distributed:
            return spent
        flag = torch.tensor(float(spent), device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def _log(self, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.write(record)

    def _evaluate(self, lengths: list[int]) -> dict[int, dict[str, Any]]:
        # Rank 0 evaluates; a sharded model needs every rank for its forwards, so there all evaluate the same
        # sequences (the parameters gathered in step) and only rank 0 keeps the numbers.
        if self.rank and not self.sharded:
            return {}
        results = evaluate(self.model, self.eval_task, lengths,
                           EvalPlan(self.cfg.eval_batches, self.cfg.eval_batch_size, device=self.device,
                                    piece=self.cfg.eval_piece, precision=self.cfg.dtype,
                                    position_buckets=self.cfg.eval_position_buckets))
        return {} if self.rank else results


def setup_distributed(device: str = "cpu", sharded: bool = False) -> bool:
    """Initialise torch.distributed from torchrun's environment (nccl for cuda, gloo for cpu): where there are several
    ranks, or, for a `sharded` run, under torchrun at all (FSDP needs a process group, even of one).

    Returns whether this process is one rank of a process group.
    """
    if dist.is_available() and dist.is_initialized():
        return True
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not (sharded and "TORCHELASTIC_RUN_ID" in os.environ):
        return False
    local = resolve_device(device, int(os.environ.get("LOCAL_RANK", "0")))
    if local.type == "cuda":
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if local.type == "cuda" else "gloo")
    return True


def train(cfg: TrainConfig, run_dir: Path, resume: bool = False, quiet: bool = False,
          force: bool = False, bar_position: int | None = None) -> TrainResult:
    """Train `cfg` into a new run directory `run_dir` (an existing titans run there only with `force`, which
    replaces it); with `resume`, continue that run from its latest checkpoint.

    The run directory is checked first and prepared only once the trainer is built (device, task, lengths
    checked): a run refused for any reason leaves an existing directory as it was and creates none.
    """
    lead = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
    if lead:
        check_run_dir(run_dir, force, resume)
    trainer = Trainer(cfg, run_dir, quiet=quiet, bar_position=bar_position)
    if lead:
        prepare_run_dir(run_dir, force, resume)
    if trainer.distributed:
        dist.barrier()
    if resume:
        trainer.resume()
    return trainer.run()
