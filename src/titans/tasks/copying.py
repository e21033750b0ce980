"""Copy and selective copy (Gu & Dao 2023, "Mamba", section 3.1): reproduce the data tokens, in
order, after a delimiter.

Layout of a sequence of length T with n data tokens: a data region of T - n - 1 positions (data
tokens among BLANKs), DELIM, then the n data tokens again (teacher forcing). Scored: DELIM and the
first n - 1 answer positions, whose targets are the n data tokens.
"""

from __future__ import annotations

import torch
from pydantic import Field

from .base import Task, TaskOptions, TokenBatch, answer_targets, register


class CopyOptions(TaskOptions):
    vocab: int = Field(16, ge=3)  # BLANK (0), DELIM (1), data tokens 2 .. vocab - 1: at least one data token
    num_tokens: int = Field(8, ge=1)  # data tokens to copy


class _Copying(Task):
    Options = CopyOptions
    BLANK, DELIM = 0, 1

    def __init__(self, options: CopyOptions):
        super().__init__(options)
        self.vocab_size = options.vocab

    def min_length(self) -> int:
        return 2 * self.options.num_tokens + 1

    def data_positions(self, batch_size: int, region: int, generator: torch.Generator) -> torch.Tensor:
        """[batch_size, num_tokens] increasing positions of the data tokens in the data region."""
        raise NotImplementedError

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        n = self.options.num_tokens
        region = length - n - 1
        data = torch.randint(2, self.vocab_size, (batch_size, n), generator=generator)
        inputs = torch.full((batch_size, length), self.BLANK, dtype=torch.long)
        inputs.scatter_(1, self.data_positions(batch_size, region, generator), data)
        inputs[:, region] = self.DELIM
        inputs[:, region + 1 :] = data
        return TokenBatch(inputs, answer_targets(inputs, n))


@register
class Copy(_Copying):
    """Data tokens at the start of the data region, BLANKs after them: memorise a block, wait, recite."""

    name = "copy"

    def data_positions(self, batch_size: int, region: int, generator: torch.Generator) -> torch.Tensor:
        return torch.arange(self.options.num_tokens).expand(batch_size, -1)


@register
class SelectiveCopy(_Copying):
    """Data tokens at random positions among BLANKs: the model must select what to keep."""

    name = "selective_copy"

    def data_positions(self, batch_size: int, region: int, generator: torch.Generator) -> torch.Tensor:
        chosen = torch.rand(batch_size, region, generator=generator).argsort(-1)[:, : self.options.num_tokens]
        return chosen.sort(-1).values
