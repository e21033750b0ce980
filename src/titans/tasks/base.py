"""What every task shares: batch types, the loss mask convention, metrics, sampling helpers, the registry.

Token tasks follow the next-token convention: `targets[b, t]` is what the model must output at
position t (the token that comes at t + 1), or IGNORE_INDEX (-100) where nothing is scored.
Each task is built from strict options (a `Config`), so a typo in a YAML file is an error, and the
options are read-only once built, so a task never changes under a running sampler.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, ClassVar, NamedTuple, Optional, Union

import torch
from pydantic import ConfigDict
from torch import Tensor

from ..config import Config
from ..data.codec import ByteCodec, TextCodec

IGNORE_INDEX = -100


class TokenBatch(NamedTuple):
    """A batch of a token task: `inputs` [B, T] long, `targets` [B, T] long (IGNORE_INDEX where unscored)."""

    inputs: Tensor
    targets: Tensor


class SeriesBatch(NamedTuple):
    """A batch of a series task: `inputs` [B, T, F] float, `targets` [B, T, F] float (each position's next step)."""

    inputs: Tensor
    targets: Tensor


class LabelBatch(NamedTuple):
    """A batch of a classification task: `inputs` [B, T, F] float (whole series), `targets` [B] long (class indices)."""

    inputs: Tensor
    targets: Tensor


Batch = Union[TokenBatch, SeriesBatch, LabelBatch]


def _predictions(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    preds = logits_or_preds.argmax(-1) if logits_or_preds.is_floating_point() else logits_or_preds
    if preds.shape != targets.shape:
        raise ValueError(f"logits_or_preds has shape {tuple(logits_or_preds.shape)}, which does not match "
                         f"targets {tuple(targets.shape)} (expected [B, T] predictions or [B, T, V] logits)")
    return preds


def exact_match(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    """[B] float: 1.0 where every scored position of the row is predicted right (a row with none scores 1)."""
    scored = targets != IGNORE_INDEX
    right = (_predictions(logits_or_preds, targets) == targets) | ~scored
    return right.all(-1).float()


def tokens_right(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    """Scalar integer: how many scored positions are predicted right (exact, to be summed over batches)."""
    return ((_predictions(logits_or_preds, targets) == targets) & (targets != IGNORE_INDEX)).sum()


def token_accuracy(logits_or_preds: Tensor, targets: Tensor) -> Tensor:
    """Scalar float: the fraction of scored positions predicted right (0 when nothing is scored)."""
    return tokens_right(logits_or_preds, targets).float() / (targets != IGNORE_INDEX).sum().clamp_min(1)


def answer_targets(inputs: Tensor, answer_len: int) -> Tensor:
    """Targets that score only the last `answer_len` tokens: targets[t] = inputs[t + 1] for t in
    [T - answer_len - 1, T - 1), IGNORE_INDEX elsewhere (the answer is read off after its prompt)."""
    targets = torch.full_like(inputs, IGNORE_INDEX)
    length = inputs.shape[-1]
    targets[..., length - answer_len - 1 : length - 1] = inputs[..., length - answer_len :]
    return targets


def distinct_tokens(low: int, high: int, batch_size: int, count: int, generator: torch.Generator) -> Tensor:
    """[batch_size, count] tokens drawn from [low, high) without replacement within each row."""
    return torch.rand(batch_size, high - low, generator=generator).argsort(-1)[:, :count] + low


def random_windows(data: Tensor, batch_size: int, width: int, generator: torch.Generator) -> Tensor:
    """[batch_size, width, ...] windows of `data` (first dim is time) at uniform random offsets."""
    starts = torch.randint(0, len(data) - width + 1, (batch_size, 1), generator=generator)
    return data[starts + torch.arange(width)]


def package_folder(package: str, install_hint: str) -> Path:
    """The folder of an installed package, found without importing it (a task that reads the data files a package
    ships needs neither its import time nor its dependencies); a ValueError with `install_hint` when it is missing."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"{package} is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


class TaskOptions(Config):
    """Base of every task's options: strict loading from `Config`, read-only after construction."""

    model_config = ConfigDict(frozen=True)


class Task:
    """Base class: `sample(batch_size, length, generator)` returns a batch of exactly `length` positions.

    Subclasses set `name`, `Options`, `vocab_size` (token tasks) or `num_features` (series tasks; with
    `num_classes` too, classification of whole series), `min_length()` (the shortest sequence that holds the task's
    content) and `_generate`; a task read from a finite labelled set also gives `full_set`.
    """

    name: ClassVar[str]
    Options: ClassVar[type[TaskOptions]]
    vocab_size: Optional[int] = None
    num_features: Optional[int] = None
    num_classes: Optional[int] = None
    byte_level: ClassVar[bool] = False  # token ids are UTF-8 bytes (prompts are text, outputs decode to text)

    def __init__(self, options: TaskOptions):
        self.options = options

    def min_length(self) -> int:
        return 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        """A batch of `batch_size` sequences of exactly `length` positions; the same generator state
        gives the same batch."""
        self._check_request(batch_size, length)
        if not isinstance(generator, torch.Generator):
            raise ValueError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        return self._generate(batch_size, length, generator)

    def sample_seeded(self, seeds: list[int], length: int) -> Batch:
        """One sequence of `length` positions per seed, row i a function of `seeds[i]` alone: how the trainer draws
        (`train.batches.sample_rows`), so that a row is the same on any rank and after a resume. By default row i is
        `sample(1, length, generator seeded by seeds[i])`; a task may draw faster as long as it stays a function of
        the seed."""
        self._check_request(len(seeds), length)
        parts = [self._generate(1, length, torch.Generator().manual_seed(seed)) for seed in seeds]
        return type(parts[0])(*(torch.cat(tensors) for tensors in zip(*parts)))

    def _check_request(self, batch_size: int, length: int) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
        minimum = self.min_length()
        if isinstance(length, bool) or not isinstance(length, int) or length < minimum:
            raise ValueError(f"length must be an integer >= {minimum} for task {self.name} "
                             f"with its options, got {length!r}")

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def recorded_options(self) -> Optional[dict[str, Any]]:
        """Options a run's config records in place of those given (None: as given); a task read from data that can
        change under it records what identifies that data (`lm_tokens`: its tokenizer's hash)."""
        return None

    def text_metrics(self, mean_loss: float) -> dict[str, float]:
        """The language-modelling metrics of a mean loss per scored token in nats (bits per byte, perplexity); none
        for tasks that are not language modelling."""
        return {}

    def bytes_per_token(self) -> Optional[float]:
        """UTF-8 bytes of text per token of the evaluated split, for bits per byte; None where it means nothing."""
        return None

    def text_codec(self) -> Optional[TextCodec]:
        """How text becomes this task's token ids and back (a prompt, generated text); None for tasks whose tokens
        are not text."""
        return ByteCodec() if self.byte_level else None

    def full_set(self, length: int) -> Optional[Batch]:
        """Every example of the task, in order, where it is a finite set (evaluation then reads each once instead of
        sampling); None for tasks that generate or window their data."""
        return None

    def held_out(self, split: Optional[str] = None) -> Task:
        """The task to evaluate on. Tasks read from data (their options have a `split`) give the same task on
        `split` (default "val"); generated tasks give themselves, their evaluation sequences coming from seeds
        that training never draws."""
        if "split" not in type(self.options).model_fields:
            if split is not None:
                raise ValueError(f"split: task {self.name} generates its data and has no splits, got {split!r}")
            return self
        values = self.options.to_dict()
        values["split"] = "val" if split is None else split
        return get_task(self.name, **values)


TASKS: dict[str, type[Task]] = {}


def register(cls: type[Task]) -> type[Task]:
    """Class decorator: make the task available to `get_task` under `cls.name`."""
    if cls.name in TASKS:
        raise ValueError(f"task name {cls.name!r} is registered twice")
    TASKS[cls.name] = cls
    return cls


def get_task(name: str, /, **options: Any) -> Task:  # positional-only: an option may be called `name`
    """Build a task by registry name; an unknown name or option, or a bad value, raises ValueError."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(sorted(TASKS))}")
    cls = TASKS[name]
    return cls(cls.Options.from_dict(options, _path=f"task {name}"))
