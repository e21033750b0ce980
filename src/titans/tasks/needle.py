"""Needle in a haystack: RULER's three single-needle forms (byte-level text) and a compact synthetic one.

Text forms (Hsieh et al. 2024, "RULER"): vocabulary = the 256 byte values, no special tokens. A
sequence is `haystack-with-needle + question + answer`, exactly `length` bytes; the haystack is the
tail of a longer text (so it may start mid-sentence, and it ends at a sentence end), the needle sits
at the sentence start nearest below fraction `depth` of it, and only the answer bytes are scored.

The synthetic `passkey` task is the cheap form our CPU demo trains on: noise tokens, one
(KEY, value) needle at a random depth, and QUERY at the very end followed by the value.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Optional

import torch
from pydantic import Field, model_validator

from .base import Task, TaskOptions, TokenBatch, answer_targets, register
from .text import WORDS, generated_text, insert_at_sentence, pick, repeated_text, tail, to_tokens

Depth = Optional[Annotated[float, Field(ge=0, le=1)]]  # fixed needle depth in [0, 1]; None = uniform


class PasskeyOptions(TaskOptions):
    vocab: int = 64  # total vocabulary: KEY, QUERY, num_values value tokens, the rest noise tokens
    num_values: int = Field(16, ge=2)  # value tokens (chance accuracy per value token 1 / num_values)
    value_len: int = Field(1, ge=1)  # tokens in the needle's value
    depth: Depth = None

    @model_validator(mode="after")
    def check_rules(self) -> PasskeyOptions:
        if self.vocab < self.num_values + 3:
            raise ValueError(f"vocab ({self.vocab}) must exceed num_values + 2 markers ({self.num_values + 2}) "
                             "to leave at least one noise token")
        return self


@register
class Passkey(Task):
    """[noise … KEY v_1..v_m noise … QUERY v_1..v_m]: after QUERY the model must output v_1..v_m.

    Tokens: KEY = 0, QUERY = 1, values 2 .. 2 + num_values - 1, noise the rest of the vocabulary.
    Depth d puts KEY at round(d * (length - 2(m + 1))), so d = 1 puts the needle right before QUERY.
    """

    name = "passkey"
    Options = PasskeyOptions
    KEY, QUERY = 0, 1

    def __init__(self, options: PasskeyOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        self.value_range = (2, 2 + options.num_values)
        self.noise_range = (2 + options.num_values, options.vocab)

    def min_length(self) -> int:
        return 2 * (self.options.value_len + 1)  # the needle and the query, no noise

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        m = self.options.value_len
        inputs = torch.randint(*self.noise_range, (batch_size, length), generator=generator)
        values = torch.randint(*self.value_range, (batch_size, m), generator=generator)
        room = length - 2 * (m + 1)  # last needle start that leaves the query block free
        if self.options.depth is None:
            starts = torch.randint(0, room + 1, (batch_size, 1), generator=generator)
        else:
            starts = torch.full((batch_size, 1), round(self.options.depth * room))
        inputs.scatter_(1, starts, self.KEY)
        inputs.scatter_(1, starts + 1 + torch.arange(m), values)
        inputs[:, length - m - 1] = self.QUERY
        inputs[:, length - m :] = values
        return TokenBatch(inputs, answer_targets(inputs, m))


class NiahOptions(TaskOptions):
    depth: Depth = None
    # length of the pass key / magic number (RULER uses 7-digit numbers); niah_word: unused
    digits: int = Field(7, ge=1, le=20)


class TextNeedle(Task):
    """Byte-level needle: subclasses give the needle and question templates and draw (key, value)."""

    Options = NiahOptions
    vocab_size = 256
    byte_level = True
    needle_template: ClassVar[str]  # with {key} and {value}
    question_template: ClassVar[str]  # with {key}; the answer (the value) follows it directly

    def draw(self, generator: torch.Generator) -> tuple[str, str]:
        """(key, value) of one needle."""
        raise NotImplementedError

    def longest_key_value(self) -> tuple[str, str]:
        """The (key, value) that makes the longest needle + question + answer."""
        raise NotImplementedError

    def haystack(self, n_bytes: int, generator: torch.Generator) -> str:
        """Text of at least n_bytes that ends at a sentence end."""
        return generated_text(n_bytes, generator)

    def parts(self, key: str, value: str) -> tuple[str, str, str]:
        """(needle, question, answer)."""
        return self.needle_template.format(key=key, value=value), self.question_template.format(key=key), value

    def number(self, generator: torch.Generator) -> str:
        """A decimal number of exactly `digits` digits (no leading zero)."""
        digits = torch.randint(0, 10, (self.options.digits,), generator=generator)
        digits[0] = 1 + digits[0] % 9
        return "".join(map(str, digits.tolist()))

    def min_length(self) -> int:
        return sum(map(len, self.parts(*self.longest_key_value())))

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        rows, targets = [], []
        for _ in range(batch_size):
            needle, question, answer = self.parts(*self.draw(generator))
            room = length - len(needle) - len(question) - len(answer)
            depth = self.options.depth
            if depth is None:
                depth = float(torch.rand((), generator=generator))
            context = insert_at_sentence(tail(self.haystack(room, generator), room), needle, depth)
            rows.append(to_tokens(context + question + answer))
            targets.append(answer_targets(rows[-1], len(answer)))
        return TokenBatch(torch.stack(rows), torch.stack(targets))


@register
class NiahPasskey(TextNeedle):
    """RULER passkey: a digit string hidden in repeated noise sentences."""

    name = "niah_passkey"
    needle_template = "The pass key is {value}. Remember it. {value} is the pass key. "
    question_template = "What is the pass key? The pass key is "

    def haystack(self, n_bytes: int, generator: torch.Generator) -> str:
        return repeated_text(n_bytes)

    def draw(self, generator: torch.Generator) -> tuple[str, str]:
        return "", self.number(generator)

    def longest_key_value(self) -> tuple[str, str]:
        return "", "9" * self.options.digits


def magic_templates(kind: str) -> tuple[str, str]:
    """RULER's needle and question for a value of `kind` keyed by a word."""
    asked = f"the special magic {kind} for {{key}} mentioned in the provided text"
    return (f"One of the special magic {kind}s for {{key}} is: {{value}}. ",
            f"What is {asked}? {asked[0].upper()}{asked[1:]} is ")


@register
class NiahNumber(TextNeedle):
    """RULER single needle: a number keyed by a word, in a haystack of generated sentences."""

    name = "niah_number"
    needle_template, question_template = magic_templates("number")

    def draw(self, generator: torch.Generator) -> tuple[str, str]:
        return pick(WORDS, generator), self.number(generator)

    def longest_key_value(self) -> tuple[str, str]:
        return max(WORDS, key=len), "9" * self.options.digits


@register
class NiahWord(TextNeedle):
    """RULER single needle with a word value: a word keyed by another word."""

    name = "niah_word"
    needle_template, question_template = magic_templates("word")

    def draw(self, generator: torch.Generator) -> tuple[str, str]:
        key = pick(WORDS, generator)
        return key, pick([w for w in WORDS if w != key], generator)

    def longest_key_value(self) -> tuple[str, str]:
        second_longest, longest = sorted(WORDS, key=len)[-2:]
        return longest, second_longest  # the key appears three times, the value twice
