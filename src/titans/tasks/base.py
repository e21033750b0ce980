"""What every task shares: batch types, the loss mask convention, metrics and the registry.

Token tasks follow the next-token convention: `targets[b, t]` is what the model must output at
position t (the token that comes at t + 1), or IGNORE_INDEX (-100) where nothing is scored.
Each task is built from a strict `Config` of its options, so a typo in a YAML file is an error.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple, Optional

import torch
from torch import Tensor

from ..config import Config

IGNORE_INDEX = -100


class TokenBatch(NamedTuple):
    inputs: Tensor  # [batch, seq] long
    targets: Tensor  # [batch, seq] long, IGNORE_INDEX where no loss


class SeriesBatch(NamedTuple):
    inputs: Tensor  # [batch, seq, features] float
    targets: Tensor  # [batch, seq, features] float: the next step of every position


def predictions(logits_or_preds: Tensor) -> Tensor:
    return logits_or_preds.argmax(-1) if logits_or_preds.is_floating_point() else logits_or_preds


def exact_match(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    """[batch] 1.0 where every scored position of the row is right (rows with none score 1)."""
    scored = targets != IGNORE_INDEX
    right = (predictions(logits_or_preds) == targets) | ~scored
    return right.all(-1).float()


def token_accuracy(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    """Fraction of scored positions predicted right (a scalar)."""
    scored = targets != IGNORE_INDEX
    right = (predictions(logits_or_preds) == targets) & scored
    return right.sum().float() / scored.sum().clamp_min(1)


class Task:
    """Base class: `sample(batch_size, length, generator)` returns a batch of exactly `length` positions."""

    name: ClassVar[str]
    Options: ClassVar[type[Config]]
    vocab_size: Optional[int] = None  # token tasks
    num_features: Optional[int] = None  # series tasks

    def __init__(self, options: Config):
        self.options = options

    def min_length(self) -> int:
        return 1

    def check_length(self, length: int) -> None:
        if not isinstance(length, int) or length < self.min_length():
            raise ValueError(f"length must be an integer >= {self.min_length()} for task {self.name}, got {length!r}")

    def sample(self, batch_size: int, length: int, generator: torch.Generator):
        raise NotImplementedError


TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def get_task(name: str, **options: Any) -> Task:
    """Build a task by registry name with its options (unknown names/options raise ValueError)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    return cls(cls.Options.from_dict(options, _path=f"task {name}"))


def randint(low: int, high: int, shape, generator: torch.Generator) -> Tensor:
    return torch.randint(low, high, shape, generator=generator)


def option_fields(cls: type[Task]) -> list[str]:
    return [f.name for f in dataclasses.fields(cls.Options)]
