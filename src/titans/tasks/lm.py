"""Byte-level language modelling on a directory of text files (default: Python's standard library).

Files are split into train/validation by a hash of their relative path (deterministic, disjoint);
each split is read once and kept as one byte tensor; batches are random windows of length + 1 bytes.
Report bits per byte: mean cross-entropy in nats / ln 2.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch

from ..config import Config
from .base import Task, TokenBatch, register


def bits_per_byte(mean_nll_nats: float) -> float:
    return mean_nll_nats / math.log(2)


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass
class LmOptions(Config):
    root: str = ""  # directory of text files; empty = the Python standard library
    pattern: str = "*.py"
    split: Literal["train", "val"] = "train"
    val_fraction: float = 0.1

    def validate(self) -> None:
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")


def file_split(relative: str, val_fraction: float) -> str:
    digest = int(hashlib.sha256(relative.encode()).hexdigest()[:8], 16)
    return "val" if digest / 0xFFFFFFFF < val_fraction else "train"


@lru_cache(maxsize=8)
def corpus_bytes(root: str, pattern: str, split: str, val_fraction: float) -> torch.Tensor:
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"text root {root} is not a directory")
    files = sorted(p for p in base.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)
    chunks = [p.read_bytes() for p in files if file_split(str(p.relative_to(base)), val_fraction) == split]
    data = b"\n".join(chunks)
    if not data:
        raise ValueError(f"no {pattern} files for the {split} split under {root}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@register
class LmBytes(Task):
    name = "lm_bytes"
    Options = LmOptions
    vocab_size = 256

    @property
    def data(self) -> torch.Tensor:
        o = self.options
        return corpus_bytes(o.root or stdlib_root(), o.pattern, o.split, o.val_fraction)

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> TokenBatch:
        self.check_length(length)
        data = self.data
        if len(data) <= length + 1:
            raise ValueError(f"corpus has {len(data)} bytes, fewer than length + 1 = {length + 1}")
        starts = torch.randint(0, len(data) - length - 1, (batch_size,), generator=generator)
        windows = torch.stack([data[s : s + length + 1] for s in starts.tolist()]).long()
        return TokenBatch(windows[:, :-1], windows[:, 1:])
