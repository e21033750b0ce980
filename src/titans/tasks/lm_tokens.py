"""Language modelling on token shards (`titans data prepare`): a subword tokenizer, a corpus of any size.

Each split's shards are memory-mapped, never read whole; a batch row is a window of length + 1 consecutive tokens at a
uniform random start among every start in every shard (a window does not cross from one shard into the next; within a
shard it crosses documents, whose end-of-text tokens it keeps, as GPT-style training does). Every position is scored.
The trainer draws row i of a step from a generator of its own (`batches.sample_rows`), so each rank of a torchrun reads
its own windows, and `carry_windows` reads streams of consecutive windows out of one longer draw.

Evaluation reports the validation loss per token, its perplexity and bits per byte: the loss in bits times the split's
tokens per byte of text (`ShardMetadata`; the end-of-text tokens count as tokens and carry no bytes).

The tokenizer is part of the data: the shards record its SHA-256, and a run records it too (`tokenizer_sha256`, filled
in when the config is loaded), so shards re-made with another tokenizer are refused by the runs trained on the old ones.
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np
import torch
from pydantic import model_validator

from ..data.codec import TokenizerCodec
from ..data.shards import ShardMetadata, open_split, read_metadata
from ..data.tokenizer import load_tokenizer, tokenizer_hash
from .base import Task, TaskOptions, TokenBatch, register
from .lm import bits_per_byte


class LmTokensOptions(TaskOptions):
    data: str = ""  # a shard directory (`titans data prepare --out`)
    split: Literal["train", "val"] = "train"
    # the SHA-256 of the tokenizer the run trained with ("": the shards'; a loaded config records it)
    tokenizer_sha256: str = ""

    @model_validator(mode="after")
    def check_rules(self) -> LmTokensOptions:
        if not self.data:
            raise ValueError("data must name a shard directory (made by `titans data prepare`)")
        return self


@register
class LmTokens(Task):
    """Random windows of a split's token shards: inputs tokens t .. t + T - 1, targets t + 1 .. t + T."""

    name = "lm_tokens"
    Options = LmTokensOptions

    def __init__(self, options: LmTokensOptions):
        super().__init__(options)
        self.metadata: ShardMetadata = read_metadata(options.data)
        recorded = self.metadata.tokenizer.sha256
        if options.tokenizer_sha256 and options.tokenizer_sha256 != recorded:
            raise ValueError(f"the shards in {options.data} were made with tokenizer {recorded[:16]}..., not "
                             f"{options.tokenizer_sha256[:16]}... (the tokenizer this run was trained with): "
                             "prepare them again with that tokenizer, or start a new run")
        self.vocab_size = self.metadata.tokenizer.vocab_size
        stats = self.metadata.splits[options.split]
        self.longest_shard = max((s.tokens for s in stats.shards), default=0)
        self._ends: dict[int, np.ndarray] = {}

    def min_length(self) -> int:
        return 1

    def recorded_options(self) -> dict[str, Any]:
        """The options with the shards' tokenizer hash filled in: what the run's config records."""
        return {**self.options.to_dict(), "tokenizer_sha256": self.metadata.tokenizer.sha256}

    @cached_property
    def _shards(self) -> tuple[np.ndarray, ...]:
        """The split's shards, memory-mapped (opened on first use)."""
        return open_split(self.options.data, self.options.split)

    def _starts(self, width: int) -> np.ndarray:
        """The cumulative count of the starts of windows of `width` tokens that each shard holds (kept per width: a
        row is drawn at a time, and a corpus may have thousands of shards)."""
        if width not in self._ends:
            self._ends[width] = np.cumsum([max(0, len(s) - width + 1) for s in self._shards], dtype=np.int64)
        return self._ends[width]

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        total = self._total_starts(length)
        return self._windows(torch.randint(0, total, (batch_size,), generator=generator).numpy(), length)

    def sample_seeded(self, seeds: list[int], length: int) -> TokenBatch:
        """Row i starts at `seeds[i]` mod the number of window starts. The trainer's seeds are 63-bit hashes
        (`derive_seed`), so this is a uniform draw (the modulo's bias is below starts / 2^63: 1e-7 for a split of
        a trillion tokens), made without a torch generator per row, which cost more than copying the row."""
        self._check_request(len(seeds), length)
        total = self._total_starts(length)
        return self._windows(np.array([seed % total for seed in seeds], dtype=np.int64), length)

    def _total_starts(self, length: int) -> int:
        ends = self._starts(length + 1)
        total = int(ends[-1]) if len(ends) else 0
        if total == 0:
            raise ValueError(f"length {length} is too long for the {self.options.split} split of {self.options.data}: "
                             f"its longest shard holds {self.longest_shard} tokens, fewer than length + 1 (prepare "
                             "it with a larger --shard-mib, or use shorter lengths)")
        return total

    def _windows(self, picks: np.ndarray, length: int) -> TokenBatch:
        """The windows of length + 1 tokens at the given indices into every window start of every shard."""
        width, shards, ends = length + 1, self._shards, self._starts(length + 1)
        which = np.searchsorted(ends, picks, side="right")
        offsets = picks - np.concatenate([[0], ends[:-1]])[which]
        rows = np.stack([shards[s][o:o + width] for s, o in zip(which.tolist(), offsets.tolist())])
        windows = torch.from_numpy(rows.astype(np.int64))
        return TokenBatch(windows[:, :-1], windows[:, 1:])

    def bytes_per_token(self) -> float:
        stats = self.metadata.splits[self.options.split]
        return stats.bytes / stats.tokens

    def text_metrics(self, mean_loss: float) -> dict[str, float]:
        return {"perplexity": math.exp(min(mean_loss, 700.0)),  # past e^700 a float overflows; it is inf then
                "bits_per_byte": bits_per_byte(mean_loss) / self.bytes_per_token()}

    def text_codec(self) -> Optional[TokenizerCodec]:
        tokenizer = load_tokenizer(Path(self.options.data) / self.metadata.tokenizer.file)
        if tokenizer_hash(tokenizer) != self.metadata.tokenizer.sha256:
            raise ValueError(f"{Path(self.options.data) / self.metadata.tokenizer.file} is not the tokenizer the "
                             f"shards were made with (SHA-256 {self.metadata.tokenizer.sha256[:16]}...): it was "
                             "changed after the preparation; prepare the shards again")
        return TokenizerCodec(tokenizer, self.metadata.tokenizer.eot_id)
