"""Byte-level language modelling on a directory of text files (default: Python's standard library).

Files are split into train/validation by a hash of their relative path (deterministic on every
machine, and disjoint by construction); each split is read once per process and kept as one byte
tensor; batches are random windows of length + 1 bytes (vocabulary 256, every position scored).
Report bits per byte: mean cross-entropy in nats / ln 2.

The split separates files, not content: the standard library repeats code across files, and about 2.5% of
2048-byte validation windows (8% of 128-byte ones) also occur verbatim in the training files (measured on
CPython 3.11's library). Validation bits per byte are therefore slightly optimistic; nothing de-duplicates.
"""

from __future__ import annotations

import hashlib
import math
import sysconfig
from functools import lru_cache
from pathlib import Path, PurePath
from typing import Literal

import torch
from pydantic import Field, model_validator

from .base import Task, TaskOptions, TokenBatch, random_windows, register


def bits_per_byte(mean_nll_nats: float) -> float:
    """Bits per byte from the mean negative log-likelihood per byte in nats."""
    return mean_nll_nats / math.log(2)


@lru_cache(maxsize=1)
def stdlib_root() -> str:
    """The Python standard library's source directory (present on every Python install). Cached: sysconfig expands
    its install scheme on every call (0.8 ms, once per row of every batch before it was cached)."""
    return sysconfig.get_paths()["stdlib"]


class LmOptions(TaskOptions):
    root: str = ""  # directory of text files; empty = the Python standard library
    pattern: str = "*.py"  # glob of the files to use, searched recursively
    split: Literal["train", "val"] = "train"
    val_fraction: float = Field(0.1, gt=0, lt=1)

    @model_validator(mode="after")
    def check_rules(self) -> LmOptions:
        if self.root and not Path(self.root).is_dir():
            raise ValueError(f"root {self.root!r} is not a directory")
        if not self.pattern:
            raise ValueError("pattern must be a file glob such as '*.py'")
        pattern = PurePath(self.pattern)
        # pathlib's glob refuses an absolute pattern (a traceback) and '**' inside a name (only at the first read);
        # '..' would reach files outside root
        if pattern.anchor or ".." in pattern.parts:
            raise ValueError(f"pattern {self.pattern!r} must be relative to root and stay inside it, such as '*.py' "
                             "or 'pkg/*.py' (set root to search another directory)")
        if any("**" in part and part != "**" for part in pattern.parts):
            raise ValueError(f"pattern {self.pattern!r}: '**' must be a whole path component, such as '**/*.py'")
        return self


def file_split(relative_path: str, val_fraction: float) -> Literal["train", "val"]:
    """The split of a file, from a hash of its relative POSIX path (the same on every machine)."""
    digest = int.from_bytes(hashlib.sha256(relative_path.encode()).digest()[:8], "big")
    return "val" if digest < val_fraction * 2**64 else "train"


def split_files(root: str, pattern: str, split: str, val_fraction: float) -> list[Path]:
    """The files of one split under `root`, sorted (third-party site-packages excluded)."""
    base = Path(root)
    files = sorted(p for p in base.rglob(pattern) if p.is_file() and "site-packages" not in p.relative_to(base).parts)
    return [p for p in files if file_split(p.relative_to(base).as_posix(), val_fraction) == split]


@lru_cache(maxsize=4)
def corpus_bytes(root: str, pattern: str, split: str, val_fraction: float) -> torch.Tensor:
    """[bytes] uint8: the split's files concatenated, each followed by a newline; read once, cached."""
    data = b"".join(p.read_bytes() + b"\n" for p in split_files(root, pattern, split, val_fraction))
    if not data:
        raise ValueError(f"root {root!r} has no {pattern} files in the {split} split")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@register
class LmBytes(Task):
    """Random windows of the corpus: inputs are bytes t .. t + T - 1, targets bytes t + 1 .. t + T."""

    name = "lm_bytes"
    Options = LmOptions
    vocab_size = 256
    byte_level = True

    @property
    def data(self) -> torch.Tensor:
        """The split's bytes (read on first use)."""
        o = self.options
        return corpus_bytes(o.root or stdlib_root(), o.pattern, o.split, o.val_fraction)

    def bytes_per_token(self) -> float:
        return 1.0

    def text_metrics(self, mean_loss: float) -> dict[str, float]:
        return {"bits_per_byte": bits_per_byte(mean_loss)}

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        data = self.data
        if len(data) < length + 1:
            raise ValueError(f"length {length} is too long for the {self.options.split} split: "
                             f"the corpus has {len(data)} bytes, fewer than length + 1")
        windows = random_windows(data, batch_size, length + 1, generator).long()
        return TokenBatch(windows[:, :-1], windows[:, 1:])


def repeated_passage_documents(data: torch.Tensor, count: int, prefix: int, passage: int, gap: int,
                               generator: torch.Generator) -> torch.Tensor:
    """[count, prefix + passage + gap + passage] int64 documents of the corpus `data` in which a passage appears
    twice: a window of prefix + passage + gap bytes as the corpus has it, then its passage (the `passage` bytes after
    the prefix) once more. The first reading starts at `prefix`, the second at `prefix + passage + gap`; between them
    lie `gap` bytes of the same text."""
    for name, value, least in (("count", count, 1), ("passage", passage, 1), ("prefix", prefix, 0), ("gap", gap, 0)):
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    width = prefix + passage + gap
    if len(data) < width:
        raise ValueError(f"the corpus has {len(data)} bytes, fewer than prefix + passage + gap = {width}")
    windows = random_windows(data, count, width, generator).long()
    return torch.cat([windows, windows[:, prefix:prefix + passage]], 1)
