"""Time-series next-step forecasting: generated sine mixtures, or any CSV with numeric columns.

Batches are `SeriesBatch(inputs [B, T, F], targets [B, T, F])`, targets being the next step of every
position (one-step-ahead forecasting at every time step; a causal model is scored everywhere).
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Literal, Optional

import torch
from pydantic import Field, model_validator

from .base import SeriesBatch, Task, TaskOptions, random_windows, register


class SineOptions(TaskOptions):
    num_features: int = Field(4, ge=1)
    num_components: int = Field(3, ge=1)  # sines summed per feature
    noise: float = Field(0.05, ge=0)  # std of the added gaussian noise
    min_period: float = Field(8.0, ge=2)  # periods (in steps) are drawn uniformly in [min_period, max_period]
    max_period: float = 64.0

    @model_validator(mode="after")
    def check_rules(self) -> SineOptions:
        if self.min_period > self.max_period:
            raise ValueError(f"min_period ({self.min_period}) must be <= max_period ({self.max_period})")
        return self


@register
class ForecastSine(Task):
    """Each feature of each sequence: a sum of sines with random periods, phases and amplitudes in
    [0.5, 1.5], scaled by 1/sqrt(num_components) for unit-order variance, plus gaussian noise."""

    name = "forecast_sine"
    Options = SineOptions

    def __init__(self, options: SineOptions):
        super().__init__(options)
        self.num_features = options.num_features

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> SeriesBatch:
        o = self.options
        shape = (batch_size, 1, o.num_features, o.num_components)
        period = o.min_period + (o.max_period - o.min_period) * torch.rand(shape, generator=generator)
        phase = 2 * math.pi * torch.rand(shape, generator=generator)
        amplitude = 0.5 + torch.rand(shape, generator=generator)
        steps = torch.arange(length + 1, dtype=torch.float32)[None, :, None, None]
        series = (amplitude * torch.sin(2 * math.pi * steps / period + phase)).sum(-1) / math.sqrt(o.num_components)
        series = series + o.noise * torch.randn(series.shape, generator=generator)
        return SeriesBatch(series[:, :-1], series[:, 1:])


# Header names (case-insensitive) of a timestamp column, which is never a feature even when numeric.
TIME_COLUMNS = {"date", "time", "timestamp", "datetime", "ds"}
SPLIT_ENDS = {"train": (0.0, 0.7), "val": (0.7, 0.8), "test": (0.8, 1.0)}  # fractions of the rows, in time order


def split_bounds(rows: int) -> dict[str, tuple[int, int]]:
    """split -> (first row, end row) of a series of `rows` rows split 70/10/20 by time (`SPLIT_ENDS`)."""
    return {split: (int(lo * rows), int(hi * rows)) for split, (lo, hi) in SPLIT_ENDS.items()}


def next_step_windows(data: torch.Tensor, batch_size: int, length: int, generator: torch.Generator,
                      where: str) -> SeriesBatch:
    """Windows of `length` + 1 consecutive rows of `data` [rows, features] at random offsets, as inputs (the first
    `length` rows) and targets (the same rows one step later); `where` names the data in the error when it is too
    short."""
    if len(data) < length + 1:
        raise ValueError(f"length {length} is too long for {where}: it has {len(data)} rows, fewer than length + 1")
    windows = random_windows(data, batch_size, length + 1, generator)
    return SeriesBatch(windows[:, :-1], windows[:, 1:])


class CsvOptions(TaskOptions):
    path: str = ""  # the CSV file (required: the default is refused)
    # numeric columns to use (at least one); None = every numeric non-timestamp column
    columns: Optional[list[str]] = Field(None, min_length=1)
    split: Literal["train", "val", "test"] = "train"

    @model_validator(mode="after")
    def check_rules(self) -> CsvOptions:
        if not self.path:
            raise ValueError("path must name a CSV file")
        return self


def read_numeric_csv(path: Path, columns: Optional[list[str]]) -> tuple[list[str], torch.Tensor]:
    """(names, values [rows, columns] float64) of the numeric columns of a CSV with a header row."""
    if not path.is_file():
        problem = ("is a directory, not a file" if path.is_dir() else
                   "is not a regular file" if path.exists() else "does not exist")
        raise ValueError(f"CSV file {path} {problem}")
    try:
        # utf-8-sig: a spreadsheet's byte-order mark would otherwise stick to the first column's name
        with path.open(newline="", encoding="utf-8-sig") as f:
            header, *body = list(csv.reader(f)) or [[]]
    except UnicodeDecodeError as err:
        raise ValueError(f"CSV file {path} is not UTF-8 text ({err.reason})") from None
    except csv.Error as err:  # e.g. a field over the csv module's size limit, as in a binary file
        raise ValueError(f"CSV file {path} cannot be read as CSV: {err}") from None
    if not body:
        raise ValueError(f"CSV file {path} has no data rows")

    def parsed(col: int) -> Optional[list[float]]:
        try:
            return [float(row[col]) for row in body]
        except (ValueError, IndexError):
            return None

    def first_hole(col: int) -> Optional[int]:
        """The first data row with no value in `col` (an empty cell, a short row) when every value there is a
        number: a numeric column with a hole, not a text column."""
        cells = [row[col].strip() if col < len(row) else "" for row in body]
        if not any(cells) or not all(_is_number(cell) for cell in cells if cell):
            return None
        return next(r for r, cell in enumerate(cells) if not cell)

    if columns is None:
        wanted = [c for c, name in enumerate(header) if name.strip().lower() not in TIME_COLUMNS]
    else:
        missing = [name for name in columns if name not in header]
        if missing:
            raise ValueError(f"CSV file {path} has no column(s) {missing}; its columns are {header}")
        wanted = [header.index(name) for name in columns]
    values = {c: parsed(c) for c in wanted}
    if columns is not None:
        bad = [header[c] for c, v in values.items() if v is None]
        if bad:
            raise ValueError(f"CSV file {path}: column(s) {bad} are not numeric in every row")
    for c, v in values.items():
        # Dropping a numeric column with a hole (like a text column) would silently train on fewer features.
        r = first_hole(c) if v is None else None
        if r is not None:
            raise ValueError(f"CSV file {path}: numeric column {header[c]!r} has no value in data row {r + 1} "
                             "(counting from 1 after the header); fill it, or list the columns to use in `columns`")
    numeric = [c for c, v in values.items() if v is not None]
    if not numeric:
        raise ValueError(f"CSV file {path} has no numeric columns (columns: {header})")
    for c in numeric:  # float() accepts 'nan' and 'inf', which would poison the standardisation and training
        row = next((r for r, v in enumerate(values[c]) if not math.isfinite(v)), None)
        if row is not None:
            raise ValueError(f"CSV file {path}: column {header[c]!r} has the non-finite value {body[row][c]!r} "
                             f"in data row {row + 1} (counting from 1 after the header)")
    return [header[c] for c in numeric], torch.tensor([values[c] for c in numeric], dtype=torch.float64).T


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@register
class ForecastCsv(Task):
    """Windows of a CSV time series (ETT-style: a timestamp column, then numeric columns; rows in
    time order), split 70/10/20 by time and standardised with the training split's mean and std."""

    name = "forecast_csv"
    Options = CsvOptions

    def __init__(self, options: CsvOptions):
        super().__init__(options)
        path = Path(options.path)
        self.columns, values = read_numeric_csv(path, options.columns)
        rows = len(values)
        bounds = split_bounds(rows)
        train = values[slice(*bounds["train"])]
        if len(train) < 2 or any(hi <= lo for lo, hi in bounds.values()):
            raise ValueError(f"CSV file {path} is too short ({rows} rows) to split 70/10/20 into train/val/test")
        mean, std = train.mean(0), train.std(0).clamp_min(1e-8)
        if not (torch.isfinite(mean).all() and torch.isfinite(std).all()):  # squares of values near 1e308 overflow
            raise ValueError(f"CSV file {path}: values too large to standardise (the training split's mean or "
                             "standard deviation overflows float64); rescale the data")
        self.data = ((values[slice(*bounds[options.split])] - mean) / std).float()
        self.num_features = len(self.columns)

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> SeriesBatch:
        return next_step_windows(self.data, batch_size, length, generator,
                                 f"the {self.options.split} split of {self.options.path}")
