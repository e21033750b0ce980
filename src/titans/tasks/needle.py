"""Needle in a haystack: RULER's three single-needle forms (byte-level text) and a compact synthetic one.

Text forms: the haystack is trimmed so that context + needle + question + answer is exactly `length`
bytes; only the answer bytes are scored. The synthetic `passkey` task is the cheap form our CPU demo
trains on: noise tokens, one (KEY, value) needle at a random depth, and QUERY at the end.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

import torch

from ..config import Config
from .base import IGNORE_INDEX, Task, TokenBatch, register
from .text import WORDS, generated_text, insert_at_sentence, pick, repeated_text, to_bytes


def answer_targets(inputs: torch.Tensor, answer_len: int) -> torch.Tensor:
    """Score only the last `answer_len` tokens: targets[t] = inputs[t + 1] for those."""
    targets = torch.full_like(inputs, IGNORE_INDEX)
    length = inputs.shape[-1]
    targets[..., length - answer_len - 1 : length - 1] = inputs[..., length - answer_len :]
    return targets


@dataclasses.dataclass
class PasskeyOptions(Config):
    vocab: int = 64  # total vocabulary, two markers included
    num_values: int = 16  # value tokens (chance accuracy 1 / num_values)
    value_len: int = 1  # tokens in the needle's value
    depth: Optional[float] = None  # fixed needle depth in [0, 1]; None = uniform

    def validate(self) -> None:
        if self.num_values < 2:
            raise ValueError(f"num_values must be >= 2, got {self.num_values}")
        if self.vocab < self.num_values + 3:
            raise ValueError(f"vocab ({self.vocab}) must exceed num_values + 2 markers ({self.num_values + 2})")
        if self.value_len < 1:
            raise ValueError(f"value_len must be >= 1, got {self.value_len}")
        if self.depth is not None and not 0 <= self.depth <= 1:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")


@register
class Passkey(Task):
    """[noise … KEY v_1..v_m noise … QUERY v_1..v_m]; the model must output v after QUERY."""

    name = "passkey"
    Options = PasskeyOptions
    KEY, QUERY = 0, 1

    def __init__(self, options: PasskeyOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        self.value_range = (2, 2 + options.num_values)
        self.noise_range = (2 + options.num_values, options.vocab)

    def min_length(self) -> int:
        return 2 * (self.options.value_len + 1) + 1

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        m = self.options.value_len
        inputs = torch.randint(*self.noise_range, (batch_size, length), generator=generator)
        values = torch.randint(*self.value_range, (batch_size, m), generator=generator)
        room = length - 2 * (m + 1)  # needle start positions that leave the query region free
        if self.options.depth is None:
            starts = torch.randint(0, room + 1, (batch_size,), generator=generator)
        else:
            starts = torch.full((batch_size,), round(self.options.depth * room))
        rows = torch.arange(batch_size)
        inputs[rows, starts] = self.KEY
        for j in range(m):
            inputs[rows, starts + 1 + j] = values[:, j]
        inputs[:, length - m - 1] = self.QUERY
        inputs[:, length - m :] = values
        return TokenBatch(inputs, answer_targets(inputs, m))


@dataclasses.dataclass
class NiahOptions(Config):
    depth: Optional[float] = None  # fixed needle depth in [0, 1]; None = uniform
    digits: int = 5  # length of the passkey / magic number

    def validate(self) -> None:
        if self.depth is not None and not 0 <= self.depth <= 1:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")
        if not 1 <= self.digits <= 12:
            raise ValueError(f"digits must be in [1, 12], got {self.digits}")


class TextNeedle(Task):
    """Byte-level needle tasks: subclasses make (needle, question, answer, haystack builder)."""

    Options = NiahOptions
    vocab_size = 256

    def min_length(self) -> int:
        return 160  # needle + question + answer fit with some haystack

    def _number(self, generator: torch.Generator) -> str:
        first = str(int(torch.randint(1, 10, (1,), generator=generator)))
        rest = "".join(str(int(d)) for d in torch.randint(0, 10, (self.options.digits - 1,), generator=generator))
        return first + rest

    def make(self, generator: torch.Generator) -> tuple[str, str, str]:
        """(needle, question, answer)."""
        raise NotImplementedError

    def haystack(self, n_bytes: int, generator: torch.Generator) -> str:
        return generated_text(n_bytes, generator)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        rows, row_targets = [], []
        for _ in range(batch_size):
            needle, question, answer = self.make(generator)
            room = length - len(needle) - len(question) - len(answer)
            if room < 0:
                raise ValueError(f"length {length} is too short for task {self.name}")
            depth = self.options.depth
            if depth is None:
                depth = float(torch.rand((), generator=generator))
            context = insert_at_sentence(self.haystack(room, generator)[:room], needle, depth)
            rows.append(to_bytes(context + question + answer))
            row_targets.append(answer_targets(rows[-1], len(answer.encode())))
        return TokenBatch(torch.stack(rows), torch.stack(row_targets))


@register
class NiahPasskey(TextNeedle):
    """RULER passkey: a digit string hidden in repeated noise sentences."""

    name = "niah_passkey"

    def haystack(self, n_bytes: int, generator: torch.Generator) -> str:
        return repeated_text(n_bytes)

    def make(self, generator):
        key = self._number(generator)
        return (f"The pass key is {key}. Remember it. {key} is the pass key. ",
                "What is the pass key? The pass key is ", key)


@register
class NiahNumber(TextNeedle):
    """RULER single needle: a number keyed by a word, in a haystack of generated sentences."""

    name = "niah_number"

    def make(self, generator):
        word, number = pick(WORDS, generator), self._number(generator)
        return (f"One of the special magic numbers for {word} is: {number}. ",
                f"What is the special magic number for {word}? The special magic number for {word} is: ", number)


@register
class NiahWord(TextNeedle):
    """RULER single needle: a word keyed by a word."""

    name = "niah_word"

    def make(self, generator):
        key = pick(WORDS, generator)
        value = pick([w for w in WORDS if w != key], generator)
        return (f"The special magic word for {key} is: {value}. ",
                f"What is the special magic word for {key}? The special magic word for {key} is: ", value)
