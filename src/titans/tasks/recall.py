"""Associative recall: multi-query associative recall (MQAR, Arora et al. 2023) and memory capacity."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ..config import Config
from .base import IGNORE_INDEX, Task, TokenBatch, register


@dataclasses.dataclass
class MqarOptions(Config):
    vocab: int = 256  # keys from the lower half above the filler, values from the upper half
    num_pairs: int = 8
    power_a: float = 0.01  # query gaps ~ power law with exponent power_a − 1 (Zoology's default a)

    def validate(self) -> None:
        if self.num_pairs < 1:
            raise ValueError(f"num_pairs must be >= 1, got {self.num_pairs}")
        if self.vocab < 2 * self.num_pairs + 1:
            raise ValueError(f"vocab ({self.vocab}) must hold 2 * num_pairs distinct keys and values plus a filler")
        if not 0 < self.power_a <= 1:
            raise ValueError(f"power_a must be in (0, 1], got {self.power_a}")


@register
class Mqar(Task):
    """k_1 v_1 … k_N v_N, then the query region: filler with every key once, placed at power-law
    distances; the target at each queried key is its value. As in Zoology, the value is a label only:
    the input after a query key stays filler, so answers cannot be copied from the next query."""

    name = "mqar"
    Options = MqarOptions
    FILLER = 0

    def __init__(self, options: MqarOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        half = (options.vocab - 1) // 2
        self.key_range, self.value_range = (1, 1 + half), (1 + half, options.vocab)

    def min_length(self) -> int:
        return 3 * self.options.num_pairs

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        n = self.options.num_pairs
        inputs = torch.full((batch_size, length), self.FILLER, dtype=torch.long)
        targets = torch.full_like(inputs, IGNORE_INDEX)
        context, region = 2 * n, length - 2 * n
        # gap g = 1 .. region − 1 (the last position cannot hold a query: its answer would fall outside)
        gaps = torch.arange(1, region, dtype=torch.float64)
        weights = gaps ** (self.options.power_a - 1)
        for b in range(batch_size):
            keys = torch.randperm(self.key_range[1] - self.key_range[0], generator=generator)[:n] + self.key_range[0]
            values = torch.randint(*self.value_range, (n,), generator=generator)
            inputs[b, 0:context:2], inputs[b, 1:context:2] = keys, values
            slots = torch.multinomial(weights, n, replacement=False, generator=generator) + context  # gap g -> context - 1 + g
            order = torch.randperm(n, generator=generator)
            inputs[b, slots] = keys[order]
            targets[b, slots] = values[order]
        return TokenBatch(inputs, targets)


@dataclasses.dataclass
class CapacityOptions(Config):
    vocab: int = 512
    num_pairs: int = 16

    def validate(self) -> None:
        if self.num_pairs < 1:
            raise ValueError(f"num_pairs must be >= 1, got {self.num_pairs}")
        if self.vocab < 2 * self.num_pairs + 2:
            raise ValueError(f"vocab ({self.vocab}) must hold 2 * num_pairs tokens plus filler and separator")


@register
class Capacity(Task):
    """num_pairs random key→value pairs shown once, filler, SEP, then every key (shuffled) asking
    for its value; accuracy is the fraction of values recalled."""

    name = "capacity"
    Options = CapacityOptions
    FILLER, SEP = 0, 1

    def __init__(self, options: CapacityOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        half = (options.vocab - 2) // 2
        self.key_range, self.value_range = (2, 2 + half), (2 + half, options.vocab)

    def min_length(self) -> int:
        return 4 * self.options.num_pairs + 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        n = self.options.num_pairs
        inputs = torch.full((batch_size, length), self.FILLER, dtype=torch.long)
        targets = torch.full_like(inputs, IGNORE_INDEX)
        queries = length - 2 * n  # start of the query block
        inputs[:, queries - 1] = self.SEP
        for b in range(batch_size):
            keys = torch.randperm(self.key_range[1] - self.key_range[0], generator=generator)[:n] + self.key_range[0]
            values = torch.randint(*self.value_range, (n,), generator=generator)
            inputs[b, 0 : 2 * n : 2], inputs[b, 1 : 2 * n : 2] = keys, values
            order = torch.randperm(n, generator=generator)
            inputs[b, queries::2], inputs[b, queries + 1 :: 2] = keys[order], values[order]
            targets[b, queries::2] = values[order]
        return TokenBatch(inputs, targets)


def measure_capacity(predict: Callable[[torch.Tensor], torch.Tensor], pair_counts: list[int], length: int,
                     threshold: float = 0.9, batch_size: int = 16, seed: int = 0, vocab: int = 512) -> int:
    """Largest number of pairs recalled with accuracy >= threshold (0 if none); `predict` maps
    inputs [B, T] to logits or token predictions [B, T]."""
    best = 0
    for n in sorted(pair_counts):
        task = Capacity(CapacityOptions(vocab=vocab, num_pairs=n))
        batch = task.sample(batch_size, max(length, task.min_length()), torch.Generator().manual_seed(seed))
        preds = predict(batch.inputs)
        preds = preds.argmax(-1) if preds.is_floating_point() else preds
        scored = batch.targets != IGNORE_INDEX
        accuracy = ((preds == batch.targets) & scored).sum().item() / scored.sum().item()
        if accuracy >= threshold:
            best = n
    return best
