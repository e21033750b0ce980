"""Time-series next-step forecasting: generated sine mixtures, or any CSV with numeric columns.

Batches are `SeriesBatch(inputs [B, T, F], targets [B, T, F])` with targets the next step of every
position (one-step-ahead forecasting at every time, causal models score all positions).
"""

from __future__ import annotations

import csv
import dataclasses
import math
from functools import cached_property
from pathlib import Path
from typing import Literal, Optional

import torch

from ..config import Config
from .base import SeriesBatch, Task, register


@dataclasses.dataclass
class SineOptions(Config):
    num_features: int = 4
    num_components: int = 3  # sines summed per feature
    noise: float = 0.05

    def validate(self) -> None:
        if self.num_features < 1 or self.num_components < 1:
            raise ValueError("num_features and num_components must be >= 1")
        if self.noise < 0:
            raise ValueError(f"noise must be >= 0, got {self.noise}")


@register
class ForecastSine(Task):
    name = "forecast_sine"
    Options = SineOptions

    def __init__(self, options: SineOptions):
        super().__init__(options)
        self.num_features = options.num_features

    def min_length(self) -> int:
        return 2

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> SeriesBatch:
        self.check_length(length)
        shape = (batch_size, 1, self.num_features, self.options.num_components)
        freq = 2 * math.pi / (8 + 56 * torch.rand(shape, generator=generator))  # periods 8 .. 64 steps
        phase = 2 * math.pi * torch.rand(shape, generator=generator)
        amp = 0.5 + torch.rand(shape, generator=generator)
        t = torch.arange(length + 1, dtype=torch.float32)[None, :, None, None]
        series = (amp * torch.sin(freq * t + phase)).sum(-1) / math.sqrt(self.options.num_components)
        series = series + self.options.noise * torch.randn(series.shape, generator=generator)
        return SeriesBatch(series[:, :-1], series[:, 1:])


TIME_COLUMNS = {"date", "time", "timestamp", "datetime", "ds"}


@dataclasses.dataclass
class CsvOptions(Config):
    path: str = ""
    columns: Optional[list[str]] = None  # numeric columns to use; default all numeric ones
    split: Literal["train", "val", "test"] = "train"

    def validate(self) -> None:
        if not self.path:
            raise ValueError("path must name a CSV file")


@register
class ForecastCsv(Task):
    """Windows of a CSV time series (ETT-style: a timestamp column, then numeric columns), split
    70/10/20 by time and standardised with the training split's mean and std."""

    name = "forecast_csv"
    Options = CsvOptions

    def __init__(self, options: CsvOptions):
        super().__init__(options)
        self.num_features = self.data.shape[1]

    @cached_property
    def data(self) -> torch.Tensor:
        path = Path(self.options.path)
        if not path.is_file():
            raise ValueError(f"CSV file {path} does not exist")
        with path.open(newline="") as f:
            rows = list(csv.reader(f))
        if len(rows) < 2:
            raise ValueError(f"CSV file {path} has no data rows")
        header, body = rows[0], rows[1:]

        def numeric(col: int) -> bool:
            try:
                [float(r[col]) for r in body]
            except (ValueError, IndexError):
                return False
            return True

        wanted = self.options.columns
        if wanted:
            missing = [c for c in wanted if c not in header]
            if missing:
                raise ValueError(f"CSV file {path} has no column(s) {missing}; it has {header}")
            cols = [header.index(c) for c in wanted]
            bad = [header[c] for c in cols if not numeric(c)]
            if bad:
                raise ValueError(f"CSV file {path}: column(s) {bad} are not numeric")
        else:
            # the timestamp column never counts as a feature, even when it is written as a number
            cols = [c for c in range(len(header)) if header[c].strip().lower() not in TIME_COLUMNS and numeric(c)]
        if not cols:
            raise ValueError(f"CSV file {path} has no numeric columns (header: {header})")
        values = torch.tensor([[float(r[c]) for c in cols] for r in body], dtype=torch.float32)
        n = len(values)
        train_end, val_end = int(0.7 * n), int(0.8 * n)
        train = values[:train_end]
        if len(train) < 2:
            raise ValueError(f"CSV file {path} is too short ({n} rows) to split into train/val/test")
        mean, std = train.mean(0), train.std(0).clamp_min(1e-8)
        split = {"train": values[:train_end], "val": values[train_end:val_end], "test": values[val_end:]}
        return (split[self.options.split] - mean) / std

    def sample(self, batch_size: int, length: int, generator: torch.Generator) -> SeriesBatch:
        self.check_length(length)
        if len(self.data) < length + 1:
            raise ValueError(f"the {self.options.split} split of {self.options.path} has {len(self.data)} rows, "
                             f"fewer than length + 1 = {length + 1}")
        starts = torch.randint(0, len(self.data) - length, (batch_size,), generator=generator)
        windows = torch.stack([self.data[s : s + length + 1] for s in starts.tolist()])
        return SeriesBatch(windows[:, :-1], windows[:, 1:])
