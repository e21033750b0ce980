"""`TrainConfig`: model + task + optimiser + loop settings, one YAML file per run.

Everything goes through `titans.config.Config` (strict: an unknown field or a wrong type is a
ValueError naming it). `load_train_config` reads a YAML file, applies `a.b=value` overrides, builds
the task once to check its name and options, and fills `model.vocab_size` from the task when the
file leaves it out.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal, Optional

from ..config import Config, apply_overrides, read_yaml_mapping
from ..models.config import TitansConfig
from ..tasks import Task, get_task

# Fields that may change when a run is resumed: they do not touch the weights, the data stream or the
# optimiser's trajectory up to the checkpoint (only how far it goes and what is logged along the way).
# A new `steps` stretches the cosine schedule to the new end from the resumed step on: the learning rate
# continues from where the new schedule stands, not from where the old one was.
RESUMABLE_CHANGES = frozenset({"name", "steps", "time_budget_s", "eval_every", "eval_batches", "eval_batch_size",
                               "eval_piece",
                               "checkpoint_every", "keep_checkpoints", "log_every", "max_skips_in_row", "device",
                               "threads", "tensorboard", "task.eval_lengths"})

# A run's name is the name of its directory (runs/<name>, demo/<name>): one path component that cannot climb out
# of its parent (no separator, no leading dot so neither `.` nor `..`), in characters every filesystem takes.
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
MAX_SEED = 2**63 - 1  # a signed 64-bit integer: torch.manual_seed and derive_seed (64-bit parts) take it as it is
# torch.set_num_threads crashes the process (segfault) on huge counts; no machine has more cores than this.
MAX_THREADS = 1024


@dataclasses.dataclass
class TaskConfig(Config):
    """Which task to train on (`titans.tasks.get_task(name, **options)`) and at which lengths."""

    name: str = "passkey"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    train_length: int = 256
    eval_lengths: list[int] = dataclasses.field(default_factory=lambda: [256, 512, 1024, 2048])

    def validate(self) -> None:
        if self.train_length < 1:
            raise ValueError(f"task.train_length must be >= 1, got {self.train_length}")
        if not self.eval_lengths or any(n < 1 for n in self.eval_lengths):
            raise ValueError(f"task.eval_lengths must be a non-empty list of positive lengths, got {self.eval_lengths}")


@dataclasses.dataclass
class OptimConfig(Config):
    """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio` at the last step."""

    lr: float = 1e-3
    weight_decay: float = 0.1  # on the matrices of linear/LSTM layers only (see loop.make_optimizer)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0  # max global gradient norm; 0 disables clipping
    grad_accum: int = 1  # micro-batches per step (the global batch is split into this many)

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optim.betas must lie in [0, 1), got {self.betas}")
        if self.eps <= 0:
            raise ValueError(f"optim.eps must be > 0, got {self.eps}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.grad_clip < 0:
            raise ValueError(f"optim.grad_clip must be >= 0 (0 disables), got {self.grad_clip}")
        if self.grad_accum < 1:
            raise ValueError(f"optim.grad_accum must be >= 1, got {self.grad_accum}")


@dataclasses.dataclass
class TrainConfig(Config):
    """One training run. `batch_size` is the global batch: split over ranks and accumulation steps."""

    model: TitansConfig = dataclasses.field(default_factory=TitansConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    name: str = ""  # shown in tables, plots and the default run directory; default: the model variant
    steps: int = 500
    batch_size: int = 16
    seed: int = 0  # model initialisation and the training data stream
    eval_every: int = 0  # evaluate at task.train_length every this many steps; 0: only the final evaluation
    eval_batches: int = 4
    eval_batch_size: int = 16
    eval_piece: Optional[int] = None  # evaluate through the recurrent state, this many tokens per call; None: whole
    checkpoint_every: int = 100  # 0: only at the end (or when time_budget_s runs out)
    keep_checkpoints: int = 2  # newest checkpoints kept in run_dir/checkpoints
    log_every: int = 10
    max_skips_in_row: int = 20  # stop with an error after this many steps in a row skipped (non-finite loss/gradient)
    time_budget_s: float | None = None  # stop (and checkpoint) once training took this long; None: no limit
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    dtype: Literal["float32", "float64"] = "float32"  # parameter and activation dtype
    threads: int | None = None  # torch intra-op threads of this process; None: torch's default
    tensorboard: bool = True  # also write run_dir/tensorboard when the tensorboard package is installed

    def validate(self) -> None:
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be in [0, 2**63 - 1], got {self.seed}")
        for name in ("steps", "batch_size", "eval_batches", "eval_batch_size", "keep_checkpoints", "log_every",
                     "max_skips_in_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_piece is not None and self.eval_piece < 1:
            raise ValueError(f"eval_piece must be >= 1 (or null for whole sequences), got {self.eval_piece}")
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 (0 disables), got {getattr(self, name)}")
        if self.time_budget_s is not None and self.time_budget_s <= 0:
            raise ValueError(f"time_budget_s must be > 0 (or null for no limit), got {self.time_budget_s}")
        if self.threads is not None and not 1 <= self.threads <= MAX_THREADS:
            raise ValueError(f"threads must be in [1, {MAX_THREADS}] (or null for torch's default), "
                             f"got {self.threads}")
        if self.batch_size % self.optim.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by optim.grad_accum "
                             f"({self.optim.grad_accum})")

    @property
    def run_name(self) -> str:
        return self.name or self.model.variant

    def run_dir_in(self, parent: Path) -> Path:
        """parent/<run name>: checked where the name becomes a directory (not in `validate`, so a checkpoint whose
        config carries any name still loads), since `../x` or `/x` would put the run outside `parent`."""
        if not RUN_NAME.fullmatch(self.run_name):
            raise ValueError(f"name must be letters, digits, '-', '_' and '.', not starting with '.' (it names the "
                             f"run directory in {parent}), got {self.run_name!r}; or pick the directory with --out")
        return Path(parent) / self.run_name


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "options":
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def resume_mismatches(saved: TrainConfig, current: TrainConfig) -> list[str]:
    """The dotted fields (`model.dim (16 -> 32)`) in which `current` may not differ from the run it resumes."""
    old, new = _flatten(saved.to_dict()), _flatten(current.to_dict())
    return [f"{key} ({old.get(key)!r} -> {new.get(key)!r})" for key in sorted(old.keys() | new.keys())
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      data: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML file (or take `data`), apply overrides, check the task, fill `model.vocab_size` from it.

    Overrides are `a.b=value` (value parsed as YAML); top-level fields may also be written with a
    `train.` prefix (`train.steps=10` is `steps=10`).
    """
    if data is None:
        if path is None:
            raise ValueError("a config file path or a data mapping is required")
        data = read_yaml_mapping(path)
    overrides = [item.removeprefix("train.") for item in overrides or []]
    data = apply_overrides(data, overrides)
    cfg = TrainConfig.from_dict(data)
    task = get_task(cfg.task.name, **cfg.task.options)
    lengths_of = (("task.train_length", [cfg.task.train_length]), ("task.eval_lengths", cfg.task.eval_lengths))
    for field, lengths in lengths_of:
        if min(lengths) < task.min_length():
            raise ValueError(f"{field} ({min(lengths)}) is shorter than task {task.name} needs "
                             f"({task.min_length()} with its options)")
    if task.vocab_size is not None and "vocab_size" not in (data.get("model") or {}):
        cfg.model = cfg.model.replace(vocab_size=task.vocab_size)
    check_model_fits_task(cfg.model, task)
    return cfg


def check_model_fits_task(model: TitansConfig, task: Task) -> None:
    """A token task's vocabulary must fit the model's embedding table."""
    if task.vocab_size is not None and model.vocab_size < task.vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than task {task.name}'s vocabulary "
                         f"({task.vocab_size})")
