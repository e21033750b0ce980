"""Time-series classification on the UCR/UEA archive's sets: labelled series read from `.ts` files.

The files come from an installed package, never from the network: the `aeon` toolkit ships a few archive sets inside
its wheel (`aeon/datasets/data/<Name>/<Name>_{TRAIN,TEST}.ts`: ItalyPowerDemand, GunPoint, ...). We only read those
files; aeon itself is never imported (its import compiles numba code for seconds), so its own dependencies need not
even be installed. `root` points at any other folder laid out the same way.

The `.ts` format: `#` comment lines, then header lines (`@problemName`, `@timeStamps`, `@missing`, `@univariate`,
`@dimensions`, `@equalLength`, `@seriesLength`, `@classLabel true <labels...>`), then `@data` and one series per line:
each dimension's values comma-separated, dimensions separated by `:`, the class label after the last `:`. We read
equal-length series without missing values or time stamps (what the archive's classification sets mostly are), and
refuse anything else with an error naming the file and line.

Batches are `LabelBatch(inputs [B, T, F] float, targets [B] long)`: the whole series and its class index (the
position of its label in the header's `@classLabel` list). The archive's protocol has two splits, TRAIN and TEST, and
no validation split: the held-out split is TEST, and evaluation reads every series of it once (`full_set`).
"""

from __future__ import annotations

import math
from functools import cached_property
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import torch
from pydantic import model_validator

from .base import LabelBatch, Task, TaskOptions, package_folder, register

SPLITS = ("train", "test")
INSTALL_HINT = ("the UCR sets are read from the files the aeon package ships: pip install aeon (the titans extra "
                "`ucr`: pip install 'titans[ucr]'), or set the task's `root` to a folder of <name>/<name>_TRAIN.ts "
                "and <name>/<name>_TEST.ts files")


class TsData(NamedTuple):
    """One `.ts` file: its problem name, series [N, T, F] float32, class indices [N] long, and the class labels in
    the header's order (index i is `classes[i]`)."""

    problem: str
    series: torch.Tensor
    labels: torch.Tensor
    classes: tuple[str, ...]


def _flag(value: str, key: str, where: str) -> bool:
    word = value.strip().lower()
    if word not in ("true", "false"):
        raise ValueError(f"{where}: @{key} must be true or false, got {value.strip()!r}")
    return word == "true"


def read_ts(path: str | Path) -> TsData:
    """Parse a `.ts` classification file of equal-length series without missing values (see the module's text)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f".ts file {path} {'is a directory, not a file' if path.is_dir() else 'does not exist'}")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise ValueError(f".ts file {path} is not UTF-8 text ({err.reason})") from None
    header: dict[str, str] = {}
    start = None
    for number, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not line.startswith("@"):
            raise ValueError(f"{path}, line {number}: a data line before @data")
        key, _, value = line[1:].partition(" ")
        key = key.lower()
        if key == "data":
            start = number
            break
        header[key] = value.strip()
    if start is None:
        raise ValueError(f"{path} has no @data line")
    where = f"{path}"
    for key, wanted, problem in (("timestamps", False, "time stamps"), ("missing", False, "missing values"),
                                 ("equallength", True, "series of unequal lengths")):
        if key in header and _flag(header[key], key, where) != wanted:
            raise ValueError(f"{path}: {problem} are not supported (@{key} {header[key]})")
    label_words = header.get("classlabel", "").split()
    if not label_words or not _flag(label_words[0], "classLabel", where):
        raise ValueError(f"{path}: not a classification set (its header needs '@classLabel true <labels>')")
    classes = tuple(label_words[1:])
    if len(classes) < 2 or len(set(classes)) != len(classes):
        raise ValueError(f"{path}: @classLabel must list two or more distinct labels, got {list(classes)}")
    index = {label: i for i, label in enumerate(classes)}
    if "serieslength" in header and not header["serieslength"].isdigit():
        raise ValueError(f"{path}: @seriesLength must be a whole number, got {header['serieslength']!r}")
    length = int(header["serieslength"]) if "serieslength" in header else None
    series, labels = [], []
    for number, raw in enumerate(lines[start:], start + 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        *dims, label = line.split(":")
        if not dims:
            raise ValueError(f"{path}, line {number}: no ':' before the class label")
        label = label.strip()
        if label not in index:
            raise ValueError(f"{path}, line {number}: class label {label!r} is not in @classLabel {list(classes)}")
        try:
            values = [[float(v) for v in dim.split(",")] for dim in dims]
        except ValueError:
            raise ValueError(f"{path}, line {number}: values must be comma-separated numbers") from None
        if any(not math.isfinite(v) for dim in values for v in dim):
            raise ValueError(f"{path}, line {number}: non-finite value (NaN or infinity)")
        steps = length if length is not None else series[0].shape[0] if series else len(values[0])
        dimensions = series[0].shape[1] if series else len(values)
        if len(values) != dimensions or any(len(dim) != steps for dim in values):
            raise ValueError(f"{path}, line {number}: {len(values)} dimension(s) of length(s) "
                             f"{sorted({len(dim) for dim in values})}, where the set's series have {dimensions} "
                             f"of length {steps}")
        series.append(torch.tensor(values, dtype=torch.float32).T)
        labels.append(index[label])
    if not series:
        raise ValueError(f"{path} has no series after @data")
    return TsData(header.get("problemname", path.stem), torch.stack(series), torch.tensor(labels), classes)


def bundled_root() -> Path:
    """The folder of UCR sets inside the installed aeon package (found without importing it)."""
    return package_folder("aeon", INSTALL_HINT) / "datasets" / "data"


def load_ucr(dataset: str, root: Optional[str | Path] = None) -> dict[str, TsData]:
    """Both splits of `dataset` ({"train": ..., "test": ...}) from `root` (default: aeon's bundled sets), checked
    to agree on the classes, the series length and the number of dimensions."""
    folder = (Path(root) if root else bundled_root()) / dataset
    if not folder.is_dir():
        known = sorted(p.name for p in folder.parent.iterdir() if (p / f"{p.name}_TRAIN.ts").is_file()) \
            if folder.parent.is_dir() else []
        raise ValueError(f"no UCR set {dataset!r}: {folder} is not a folder" +
                         (f"; sets there: {', '.join(known)}" if known else f" ({INSTALL_HINT})"))
    splits = {split: read_ts(folder / f"{dataset}_{split.upper()}.ts") for split in SPLITS}
    train, test = splits["train"], splits["test"]
    if train.classes != test.classes or train.series.shape[1:] != test.series.shape[1:]:
        raise ValueError(f"UCR set {dataset}: the TRAIN and TEST files disagree (classes {list(train.classes)} and "
                         f"{list(test.classes)}, series [length, dimensions] {list(train.series.shape[1:])} and "
                         f"{list(test.series.shape[1:])})")
    return splits


class UcrOptions(TaskOptions):
    dataset: str = "ItalyPowerDemand"  # a folder name under root: <dataset>/<dataset>_{TRAIN,TEST}.ts
    split: Literal["train", "test"] = "train"
    root: Optional[str] = None  # folder of sets; None: the ones aeon ships

    @model_validator(mode="after")
    def check_rules(self) -> UcrOptions:
        if not self.dataset or Path(self.dataset).name != self.dataset or self.dataset.startswith("."):
            raise ValueError(f"dataset must name one set (a folder name, no path), got {self.dataset!r}")
        if self.root is not None and not self.root:
            raise ValueError("root must name a folder (or be left out for aeon's bundled sets)")
        return self


@register
class UcrClassification(Task):
    """Classify whole series of a UCR set. The files are read on first use (sampling, `num_features`,
    `num_classes`), not when the task is built, so a config naming a set loads and expands where the set is not
    installed; training it then fails before anything is written, naming what to install."""

    name = "ucr"
    Options = UcrOptions

    @cached_property
    def data(self) -> TsData:
        return load_ucr(self.options.dataset, self.options.root)[self.options.split]

    @property
    def num_features(self) -> int:  # type: ignore[override]
        return self.data.series.shape[2]

    @property
    def num_classes(self) -> int:  # type: ignore[override]
        return len(self.data.classes)

    @property
    def series_length(self) -> int:
        return self.data.series.shape[1]

    def _check_length(self, length: int) -> None:
        if length != self.series_length:
            raise ValueError(f"length {length}: the series of UCR set {self.options.dataset} are "
                             f"{self.series_length} steps long; train and evaluate at that length")

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> LabelBatch:
        self._check_length(length)
        rows = torch.randint(0, len(self.data.labels), (batch_size,), generator=generator)
        return LabelBatch(self.data.series[rows], self.data.labels[rows])

    def full_set(self, length: int) -> LabelBatch:
        self._check_length(length)
        return LabelBatch(self.data.series, self.data.labels)

    def held_out(self, split: Optional[str] = None) -> Task:
        """The TEST split by default: the archive has no validation split, and its protocol scores TEST."""
        return super().held_out("test" if split is None else split)
