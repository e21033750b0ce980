"""Copy and selective copy (Gu & Dao 2023): reproduce data tokens, in order, after a delimiter."""

from __future__ import annotations

import dataclasses

import torch

from ..config import Config
from .base import IGNORE_INDEX, Task, TokenBatch, register


@dataclasses.dataclass
class CopyOptions(Config):
    vocab: int = 16  # includes BLANK (0) and DELIM (1)
    num_tokens: int = 8  # data tokens to copy

    def validate(self) -> None:
        if self.vocab < 3:
            raise ValueError(f"vocab must be >= 3, got {self.vocab}")
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {self.num_tokens}")


class _Copying(Task):
    Options = CopyOptions
    BLANK, DELIM = 0, 1

    def __init__(self, options: CopyOptions):
        super().__init__(options)
        self.vocab_size = options.vocab

    def min_length(self) -> int:
        return 2 * self.options.num_tokens + 1

    def positions(self, room: int, n: int, generator: torch.Generator) -> torch.Tensor:
        raise NotImplementedError

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        n = self.options.num_tokens
        room = length - n - 1  # data region; then DELIM and n answer slots
        inputs = torch.full((batch_size, length), self.BLANK, dtype=torch.long)
        data = torch.randint(2, self.vocab_size, (batch_size, n), generator=generator)
        for b in range(batch_size):
            inputs[b, self.positions(room, n, generator)] = data[b]
        inputs[:, room] = self.DELIM
        inputs[:, room + 1 :] = data  # teacher forcing: answer tokens are the next inputs
        targets = torch.full_like(inputs, IGNORE_INDEX)
        targets[:, room : length - 1] = data
        return TokenBatch(inputs, targets)


@register
class Copy(_Copying):
    """Data tokens at the start of the data region, blanks after them."""

    name = "copy"

    def positions(self, room, n, generator):
        return torch.arange(n)


@register
class SelectiveCopy(_Copying):
    """Data tokens scattered at random positions among blanks: the model must select them."""

    name = "selective_copy"

    def positions(self, room, n, generator):
        return torch.randperm(room, generator=generator)[:n].sort().values
