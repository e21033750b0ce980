"""`TrainConfig`: model + task + optimiser + loop settings, one YAML file per run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Optional

from ..config import Config, apply_overrides, read_yaml_mapping
from ..models.config import TitansConfig


@dataclasses.dataclass
class TaskConfig(Config):
    name: str = "passkey"
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    train_length: int = 256
    eval_lengths: list[int] = dataclasses.field(default_factory=lambda: [256, 512, 1024, 2048])

    def validate(self) -> None:
        if self.train_length < 1:
            raise ValueError(f"task.train_length must be >= 1, got {self.train_length}")
        if any(n < 1 for n in self.eval_lengths):
            raise ValueError(f"task.eval_lengths must be positive, got {self.eval_lengths}")


@dataclasses.dataclass
class OptimConfig(Config):
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # 0 disables
    grad_accum: int = 1

    def validate(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if self.grad_accum < 1:
            raise ValueError(f"optim.grad_accum must be >= 1, got {self.grad_accum}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclasses.dataclass
class TrainConfig(Config):
    model: TitansConfig = dataclasses.field(default_factory=TitansConfig)
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    name: str = ""  # shown in tables and plots; default: the model variant
    steps: int = 500
    batch_size: int = 16  # global batch (split across ranks and accumulation steps)
    seed: int = 0
    eval_every: int = 0  # 0: evaluate only at the end
    eval_batches: int = 4
    checkpoint_every: int = 100  # 0: only at the end
    log_every: int = 10
    time_budget_s: Optional[float] = None  # stop early (and checkpoint) once training took this long
    device: Literal["cpu", "cuda", "auto"] = "cpu"

    def validate(self) -> None:
        for field in ("steps", "batch_size", "eval_batches", "log_every"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.batch_size % self.optim.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by optim.grad_accum "
                             f"({self.optim.grad_accum})")

    @property
    def run_name(self) -> str:
        return self.name or self.model.variant


def load_train_config(path: Optional[str | Path] = None, overrides: Optional[list[str]] = None,
                      data: Optional[dict] = None) -> TrainConfig:
    """Read a YAML (or take `data`), apply `a.b=value` overrides, fill model.vocab_size from the task."""
    if data is None:
        if path is None:
            raise ValueError("a config file or data is required")
        data = read_yaml_mapping(path)
    data = apply_overrides(data, overrides or [])
    model = data.setdefault("model", {}) or {}
    if not isinstance(model, dict):
        raise ValueError("model must be a mapping")
    if "vocab_size" not in model:
        from ..tasks import get_task

        task_data = data.get("task") or {}
        task = get_task(task_data.get("name", TaskConfig.name), **(task_data.get("options") or {}))
        if task.vocab_size is not None:
            model["vocab_size"] = task.vocab_size
        data["model"] = model
    return TrainConfig.from_dict(data)
