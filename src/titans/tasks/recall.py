"""Associative recall: multi-query associative recall (MQAR, Arora et al. 2023, "Zoology"), key-value recall across
noise, and capacity."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from pydantic import Field, model_validator

from .base import IGNORE_INDEX, Task, TaskOptions, TokenBatch, answer_targets, distinct_tokens, register, token_accuracy


def check_pairs(num_pairs: int, vocab: int, specials: int) -> None:
    """Keys and values come from disjoint halves of the non-special tokens, each needing num_pairs."""
    if (vocab - specials) // 2 < num_pairs:
        raise ValueError(f"vocab ({vocab}) must hold {specials} special token(s) plus num_pairs ({num_pairs}) "
                         f"distinct keys and as many values: at least {specials + 2 * num_pairs}")


def key_value_ranges(vocab: int, specials: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Token ranges [low, high) of the keys (lower half) and values (upper half) above the special tokens."""
    half = (vocab - specials) // 2
    return (specials, specials + half), (specials + half, vocab)


class MqarOptions(TaskOptions):
    vocab: int = 256  # token 0 is the filler; keys from the lower half of the rest, values from the upper
    num_pairs: int = Field(8, ge=1)
    # query slot s = 1, 2, ... has probability ∝ s^(power_a - 1) (Zoology's default)
    power_a: float = Field(0.01, gt=0, le=1)

    @model_validator(mode="after")
    def check_rules(self) -> MqarOptions:
        check_pairs(self.num_pairs, self.vocab, specials=1)
        return self


@register
class Mqar(Task):
    """k_1 v_1 … k_N v_N, then a query region of two-token slots holding every key once as `k v`,
    the rest filler. As in Zoology, the slot of each query is drawn without replacement with
    probability ∝ s^(power_a - 1) over slots s = 1, 2, … counted from the end of the key-value block,
    so most queries come soon after the pairs and a long tail comes late. Keys and values are
    distinct within a row. The target at each query key is its value (the next token); nothing else
    is scored.
    """

    name = "mqar"
    Options = MqarOptions
    FILLER = 0

    def __init__(self, options: MqarOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        self.key_range, self.value_range = key_value_ranges(options.vocab, specials=1)

    def min_length(self) -> int:
        return 4 * self.options.num_pairs  # the pairs, then one slot per query

    def slot_weights(self, num_slots: int) -> torch.Tensor:
        """Unnormalised probability of each query slot s = 1 .. num_slots (Zoology's power law)."""
        return torch.arange(1, num_slots + 1, dtype=torch.float64) ** (self.options.power_a - 1)

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        n = self.options.num_pairs
        keys = distinct_tokens(*self.key_range, batch_size, n, generator)
        values = distinct_tokens(*self.value_range, batch_size, n, generator)
        inputs = torch.full((batch_size, length), self.FILLER, dtype=torch.long)
        inputs[:, 0 : 2 * n : 2], inputs[:, 1 : 2 * n : 2] = keys, values
        weights = self.slot_weights((length - 2 * n) // 2).expand(batch_size, -1)
        slots = torch.multinomial(weights, n, replacement=False, generator=generator)
        # draws come out short slots first; shuffle so that which pair is asked first is uniform
        slots = slots.gather(1, torch.rand(batch_size, n, generator=generator).argsort(-1))
        query_at = 2 * n + 2 * slots
        inputs.scatter_(1, query_at, keys)
        inputs.scatter_(1, query_at + 1, values)
        targets = torch.full_like(inputs, IGNORE_INDEX).scatter_(1, query_at, values)
        return TokenBatch(inputs, targets)


class KvRecallOptions(TaskOptions):
    vocab: int = 64  # keys, then values, then noise tokens (at least one)
    num_pairs: int = Field(4, ge=1)  # pairs shown before the noise
    num_keys: int = 16  # key tokens (each row's keys are distinct)
    num_values: int = Field(16, ge=2)  # value tokens (chance accuracy 1 / num_values)

    @model_validator(mode="after")
    def check_rules(self) -> KvRecallOptions:
        if self.num_keys < self.num_pairs:
            raise ValueError(f"num_keys ({self.num_keys}) must be >= num_pairs ({self.num_pairs}): a row's keys "
                             "are distinct")
        if self.vocab <= self.num_keys + self.num_values:
            raise ValueError(f"vocab ({self.vocab}) must exceed num_keys + num_values "
                             f"({self.num_keys + self.num_values}) to leave at least one noise token")
        return self


@register
class KvRecall(Task):
    """k_1 v_1 … k_N v_N, random noise tokens, then one of the keys again: the model must output its value.

    Tokens: keys 0 .. num_keys − 1, values the next num_values, noise the rest. Only the answer is scored, so
    accuracy is the fraction of rows recalled (chance 1 / num_values); the pairs sit at the start, so the
    distance from a pair to its query grows with the length, and with noise in between (not a filler token)
    the model must hold the pairs while reading tokens it cannot ignore by identity alone.
    """

    name = "kv_recall"
    Options = KvRecallOptions

    def __init__(self, options: KvRecallOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        self.key_range = (0, options.num_keys)
        self.value_range = (options.num_keys, options.num_keys + options.num_values)
        self.noise_range = (options.num_keys + options.num_values, options.vocab)

    def min_length(self) -> int:
        return 2 * self.options.num_pairs + 2  # the pairs, the query key and its value

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        n = self.options.num_pairs
        keys = distinct_tokens(*self.key_range, batch_size, n, generator)
        values = torch.randint(*self.value_range, (batch_size, n), generator=generator)
        inputs = torch.randint(*self.noise_range, (batch_size, length), generator=generator)
        inputs[:, 0 : 2 * n : 2], inputs[:, 1 : 2 * n : 2] = keys, values
        asked = torch.randint(0, n, (batch_size, 1), generator=generator)
        inputs[:, -2:-1], inputs[:, -1:] = keys.gather(1, asked), values.gather(1, asked)
        return TokenBatch(inputs, answer_targets(inputs, 1))


class CapacityOptions(TaskOptions):
    vocab: int = 512  # FILLER, SEP, then keys (lower half of the rest) and values (upper half)
    num_pairs: int = Field(16, ge=1)

    @model_validator(mode="after")
    def check_rules(self) -> CapacityOptions:
        check_pairs(self.num_pairs, self.vocab, specials=2)
        return self


@register
class Capacity(Task):
    """k_1 v_1 … k_N v_N (distinct random keys, random values), filler, SEP, then every key once in a
    shuffled order, each followed by its value; the target at each queried key is its value, so
    token accuracy is the fraction of pairs recalled. `length - 4N - 1` filler tokens separate
    storing from recalling."""

    name = "capacity"
    Options = CapacityOptions
    FILLER, SEP = 0, 1

    def __init__(self, options: CapacityOptions):
        super().__init__(options)
        self.vocab_size = options.vocab
        self.key_range, self.value_range = key_value_ranges(options.vocab, specials=2)

    def min_length(self) -> int:
        return 4 * self.options.num_pairs + 1

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        n = self.options.num_pairs
        keys = distinct_tokens(*self.key_range, batch_size, n, generator)
        values = torch.randint(*self.value_range, (batch_size, n), generator=generator)
        order = torch.rand(batch_size, n, generator=generator).argsort(-1)
        queried_keys, queried_values = keys.gather(1, order), values.gather(1, order)
        inputs = torch.full((batch_size, length), self.FILLER, dtype=torch.long)
        inputs[:, 0 : 2 * n : 2], inputs[:, 1 : 2 * n : 2] = keys, values
        start = length - 2 * n  # the query block
        inputs[:, start - 1] = self.SEP
        inputs[:, start::2], inputs[:, start + 1 :: 2] = queried_keys, queried_values
        targets = torch.full_like(inputs, IGNORE_INDEX)
        targets[:, start::2] = queried_values
        return TokenBatch(inputs, targets)


class CapacityResult(NamedTuple):
    """`capacity`: the largest number of pairs recalled with accuracy >= threshold (0 if none);
    `accuracy`: the fraction of pairs recalled at each number of pairs tried."""

    capacity: int
    accuracy: dict[int, float]


def measure_capacity(predict: Callable[[torch.Tensor], torch.Tensor], pair_counts: list[int], *,
                     threshold: float = 0.9, gap: int = 0, vocab: int = 512, batch_size: int = 16,
                     seed: int = 0) -> CapacityResult:
    """How many random key→value pairs a model memorises from one showing.

    `predict` maps inputs [B, T] to logits [B, T, V] or predicted tokens [B, T]; each count n in
    `pair_counts` is tried on `batch_size` capacity sequences of length 4n + 1 + gap (`gap` filler
    tokens between the pairs and the queries), all drawn from one generator seeded with `seed`.
    """
    if not pair_counts:
        raise ValueError("pair_counts must name at least one number of pairs")
    if not 0 <= threshold <= 1:
        raise ValueError(f"threshold must be in [0, 1], got {threshold}")
    if gap < 0:
        raise ValueError(f"gap must be >= 0, got {gap}")
    generator = torch.Generator().manual_seed(seed)
    accuracy = {}
    for n in sorted(set(pair_counts)):
        batch = Capacity(CapacityOptions(vocab=vocab, num_pairs=n)).sample(batch_size, 4 * n + 1 + gap, generator)
        accuracy[n] = token_accuracy(predict(batch.inputs), batch.targets).item()
    passed = [n for n, acc in accuracy.items() if acc >= threshold]
    return CapacityResult(max(passed, default=0), accuracy)
