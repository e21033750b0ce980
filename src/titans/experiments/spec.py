"""An experiment: one YAML file under configs/experiments/ naming a grid, and the runs it expands to.

A `train` experiment is variants × sizes × tasks × seeds training runs, each evaluated at several lengths; its
table has one row per variant and one column per setting, a (panel, x) pair: the panel is the size (when there are
several) and the task (when x is the length and there are several tasks), x the evaluation length (`x_axis: length`)
or the task's own `x` (`x_axis: task`, e.g. the number of key-value pairs). The `capacity` and `efficiency`
experiments measure instead of training; their grids are in their own sections (see `measure.py`). A `continual`
experiment measures the trained runs of another experiment (see `continual.py`).

`quick` holds changes to the experiment (`base` merged field by field, `capacity`, `efficiency` and `continual` at
their top level, other fields replaced) that make it a few seconds long: the tier the test suite runs, so that the
runner, the JSON and the report are tested on every experiment.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, NonNegativeInt, PositiveFloat, PositiveInt, model_validator

from ..config import Config, FromList, read_yaml_mapping, shipped_configs
from ..models.config import (
    MODEL_VARIANTS,
    VARIANTS,
    ModelVariant,
    TitansConfig,
    flat_field_path,
    nest_flat_fields,
)
from ..train.config import RUN_NAME, TrainConfig, load_train_config


class TaskAxis(Config):
    """One task of the grid: a registered task with its options, its x value when `x_axis` is `task`, and its own
    training length where it needs one (a data set of fixed-length series) instead of the experiment's."""

    name: str = "passkey"
    options: dict[str, Any] = Field(default_factory=dict)
    x: Optional[float] = None
    train_length: Optional[int] = Field(None, ge=1)  # None: the experiment's


class CapacityGrid(Config):
    """The memory alone at test time: every (memory depth, expansion, chunk size) is written one capacity sequence
    per pair count and read back (`measure.capacity_point`)."""

    dim: int = Field(64, ge=2)
    memory_depths: list[PositiveInt] = Field(default_factory=lambda: [1, 2, 3, 4], min_length=1)
    expansions: list[PositiveInt] = Field(default_factory=lambda: [1, 2, 4], min_length=1)
    chunk_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 16], min_length=1)
    pair_counts: list[PositiveInt] = Field(default_factory=lambda: [8, 16, 32, 64, 128, 256], min_length=1)
    # inner learning rates tried; the best is kept
    thetas: list[PositiveFloat] = Field(default_factory=lambda: [0.1, 0.3, 1.0, 3.0, 10.0, 30.0], min_length=1)
    threshold: float = Field(0.9, gt=0, le=1)  # capacity: the most pairs recalled at least this often
    batch_size: int = Field(16, ge=1)
    memory_residual: bool = False  # the memory's residual k + MLP(k) (the library's default, the paper's: without)


class EfficiencyGrid(Config):
    """Training tokens/s and peak memory of one forward+backward step, and generation tokens/s after a prompt,
    per variant and sequence length, each point in its own process (`measure.efficiency_point`)."""

    lengths: list[PositiveInt] = Field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384], min_length=1)
    batch_size: int = Field(1, ge=1)
    repeats: int = Field(2, ge=1)  # timed steps per point (the best is kept)
    generate_tokens: int = Field(64, ge=1)  # tokens generated one at a time after a prompt of each length
    reference: bool = True  # also titans-pytorch's MemoryAsContextTransformer where installed
    threads: Optional[int] = None  # torch threads per point; None: torch's default (every core: run nothing beside)
    timeout_s: float = Field(900.0, gt=0)
    memory_cap_gib: float = Field(16.0, gt=0)


class ContinualGrid(Config):
    """The memory learning at test time (`continual.continual_results`): the trained runs of `source` (trained
    there, or here in its run directories when missing) read documents of its validation split in which a passage
    of `passage` bytes appears twice, `gap` bytes apart, after `prefix` bytes; the bits per byte of each reading."""

    source: str = "lm"  # an lm_bytes experiment of configs/experiments (its tier follows this one's)
    prefix: int = Field(512, ge=0)
    passage: int = Field(256, ge=2)  # its first byte is not scored (it follows a break in the text)
    gaps: list[NonNegativeInt] = Field(default_factory=lambda: [512, 1024, 2048, 4096], min_length=1)
    documents: int = Field(16, ge=1)  # per gap, the same for every model
    batch_size: int = Field(8, ge=1)
    piece: Optional[int] = Field(None, ge=1)  # read each document this many bytes per call through the state


class Published(Config):
    """Figures someone else published for the same experiment, shown beside ours (never mixed into our results)."""

    source: str = ""  # who published them, where
    values: dict[str, float] = Field(default_factory=dict)  # our row's label -> their figure
    setting: Optional[str] = None  # the column of ours they compare with; None: the last of the first panel

    @model_validator(mode="after")
    def check_rules(self) -> Published:
        if self.values and not self.source:
            raise ValueError("published.source must say where the published values come from")
        return self


class HeatMap(Config):
    """The figure as a heat map over two model settings of the rows (e.g. constant θ and η), instead of lines."""

    x: str = ""  # a TitansConfig field's path, e.g. memory.init_theta (a flat name, memory_init_theta, reads too)
    y: str = ""

    @model_validator(mode="after")
    def check_rules(self) -> HeatMap:
        for axis in (self.x, self.y):
            if axis and model_field(TitansConfig().to_dict(), axis) is MISSING:
                raise ValueError(f"heatmap axes must be model fields (TitansConfig, e.g. memory.init_theta), "
                                 f"got {axis!r}")
        if bool(self.x) != bool(self.y):
            raise ValueError("heatmap needs both x and y (or neither)")
        return self


class Experiment(Config):
    name: str = ""
    title: str = ""
    about: str = ""  # what is measured and how: RESULTS.md's text above the table
    discussion: str = ""  # what we think explains the results: RESULTS.md's text below them
    kind: Literal["train", "capacity", "efficiency", "continual"] = "train"
    metric: str = "accuracy"  # train: the evaluation metric reported (`titans.train.evaluate`'s keys)
    # train, token tasks: a second metric shown beside `metric` (the JSON's "second", a table under each of
    # RESULTS.md's), `metric` staying the headline: the share of the answer's tokens right beside exact match, so
    # that a model that gets part of a 7-digit key is told from one at chance (both score 0 on exact match); or exact
    # match beside a grid headlined by that share (ablations_niah, where exact match was 0 for most rows at its budget)
    second_metric: Literal["", "token_accuracy", "accuracy"] = ""
    higher_is_better: bool = True
    # rows of a model alone: ours, and other implementations' (PEER_VARIANTS) where named; default every one of ours
    variants: list[ModelVariant] = Field(default_factory=lambda: list(VARIANTS), min_length=1)
    # label -> model changes naming their variant: rows beside the variants (a variant with another memory, say)
    extra_models: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # label -> a metric of the runs' evaluation that scores a forecast made without a model on the same sequences
    # (`persistence: persistence_loss`): a row beside the models, the mean over the runs of what they report
    baselines: dict[str, str] = Field(default_factory=dict)
    # another experiment whose rows (variants and extra models, in the same tier) this one takes instead of its own
    models_from: str = ""
    sizes: dict[str, dict[str, Any]] = Field(default_factory=dict)  # label -> changes to `base`
    tasks: dict[str, TaskAxis] = Field(default_factory=dict)  # label -> task
    x_axis: Literal["length", "task"] = "length"
    x_label: str = "context length (tokens)"
    train_length: int = Field(256, ge=1)
    eval_multiples: list[PositiveInt] = Field(default_factory=lambda: [1], min_length=1)
    seeds: list[NonNegativeInt] = Field(default_factory=lambda: [0], min_length=1)  # distinct
    base: dict[str, Any] = Field(default_factory=dict)  # TrainConfig fields shared by every run
    variant_overrides: dict[str, dict[str, Any]] = Field(default_factory=dict)  # variant -> changes
    # per run: training stops (and evaluates) once it took this long
    time_budget_s: Optional[float] = Field(None, gt=0)
    # evaluate through the recurrent state in pieces of this many tokens
    stream_piece: Optional[int] = Field(None, ge=1)
    capacity: CapacityGrid = Field(default_factory=CapacityGrid)
    efficiency: EfficiencyGrid = Field(default_factory=EfficiencyGrid)
    continual: ContinualGrid = Field(default_factory=ContinualGrid)
    compare: list[FromList[tuple[str, str]]] = Field(default_factory=list)  # (model, against): ratios reported
    published: Published = Field(default_factory=Published)
    heatmap: HeatMap = Field(default_factory=HeatMap)
    quick: dict[str, Any] = Field(default_factory=dict)  # changes for the test suite's tier

    @model_validator(mode="after")
    def check_rules(self) -> Experiment:
        if not RUN_NAME.fullmatch(self.name):
            raise ValueError(f"experiment name must be letters, digits, '-', '_' and '.', got {self.name!r}")
        for label, changes in self.extra_models.items():
            if label in MODEL_VARIANTS or not RUN_NAME.fullmatch(label.replace(" ", "-")):
                raise ValueError(f"extra_models: {label!r} must be a new row label (letters, digits, spaces, '-', "
                                 "'_', '.'), not a variant's name")
            if changes.get("variant") not in MODEL_VARIANTS:
                raise ValueError(f"extra_models.{label} must name its variant (one of {', '.join(MODEL_VARIANTS)}), "
                                 f"got {changes.get('variant')!r}")
        for label in self.baselines:
            if label in MODEL_VARIANTS or label in self.extra_models or \
                    not RUN_NAME.fullmatch(label.replace(" ", "-")):
                raise ValueError(f"baselines: {label!r} must be a new row label (letters, digits, spaces, '-', '_', "
                                 "'.'), not a variant's or an extra model's")
        unknown_rows = sorted(set(self.published.values) - set(MODEL_VARIANTS) - set(self.extra_models)
                              - set(self.baselines))
        if unknown_rows:
            raise ValueError(f"published.values names rows not in the grid (not a variant, an extra model or a "
                             f"baseline): {unknown_rows}")
        if sorted(set(self.variant_overrides) - set(self.variants)):
            raise ValueError(f"variant_overrides names variants not in the grid: "
                             f"{sorted(set(self.variant_overrides) - set(self.variants))}")
        if self.kind != "train":
            return self
        if not self.tasks:
            raise ValueError("a train experiment needs at least one task")
        if self.x_axis == "task" and any(t.x is None for t in self.tasks.values()):
            raise ValueError("x_axis: task needs an `x` value on every task")
        if len(set(self.seeds)) != len(self.seeds):
            raise ValueError(f"seeds must be distinct, got {self.seeds}")
        if self.second_metric == self.metric:
            raise ValueError(f"second_metric must differ from metric ({self.metric!r}): it is shown beside it")
        return self

    @property
    def eval_lengths(self) -> list[int]:
        return [m * self.train_length for m in self.eval_multiples]

    def lengths_of(self, task: TaskAxis) -> tuple[int, list[int]]:
        """(training length, evaluation lengths) of a task of the grid: its own training length or the
        experiment's, times `eval_multiples`."""
        train_length = task.train_length or self.train_length
        return train_length, [m * train_length for m in self.eval_multiples]

    @property
    def models(self) -> dict[str, dict[str, Any]]:
        """Every row: label -> model changes (a variant alone, or an extra model)."""
        return {**{variant: {"variant": variant} for variant in self.variants}, **self.extra_models}


MERGED = ("base", "capacity", "efficiency", "continual")  # the sections `quick` changes field by field


def merge(base: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """`base` with `changes` applied section by section (nested mappings merge, everything else is replaced). A model
    section's flat fields (`memory_depth`, `window`) are nested first on both sides, so that a change wins however
    either side spells the field."""
    merged = dict(base)
    for key, value in changes.items():
        if key == "model" and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(nest_flat_fields(merged[key]), nest_flat_fields(value))
        elif isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in ("options",):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


MISSING = object()


def model_field(model: dict[str, Any], path: str) -> Any:
    """The value at a field's path (`memory.init_theta`, `attention.window`, or a flat name, `memory_init_theta`,
    `window`) of a model config's mapping, flat or nested (a results JSON's records hold both); MISSING where it has
    none."""
    node: Any = nest_flat_fields(model)
    if "." not in path:
        path = flat_field_path(path) or path
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def experiments_dir() -> Path:
    """configs/experiments in the working directory, else in the source checkout this package runs from."""
    folder = shipped_configs("experiments")
    if folder is None:
        raise ValueError("no configs/experiments/*.yaml found here or in the titans checkout")
    return folder


def experiment_names(folder: Path | None = None) -> list[str]:
    return sorted(p.stem for p in (folder or experiments_dir()).glob("*.yaml"))


def load_experiment(name: str, quick: bool = False, folder: Path | None = None) -> Experiment:
    """configs/experiments/NAME.yaml (NAME may also be a path to a YAML file), with its quick changes if asked."""
    path = Path(name) if name.endswith((".yaml", ".yml")) else (folder or experiments_dir()) / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(experiment_names(folder)) if not name.endswith((".yaml", ".yml")) else ""
        raise ValueError(f"no experiment {name!r} ({path} does not exist)" + (f"; known: {known}" if known else ""))
    data = read_yaml_mapping(path)
    if data.get("name", path.stem) != path.stem:
        raise ValueError(f"{path}: name {data.get('name')!r} must be the file's name {path.stem!r}")
    data.setdefault("name", path.stem)
    source = data.get("models_from")
    if source:  # the rows of another experiment of the same folder and tier: one list of models for both
        if {"variants", "extra_models"} & (set(data) | set(data.get("quick") or {})):
            raise ValueError(f"{path}: models_from takes the rows of {source!r}; variants and extra_models cannot "
                             "be set beside it")
        source_path = path.parent / f"{source}.yaml"
        if source_path.is_file() and read_yaml_mapping(source_path).get("models_from"):  # no chains, no cycles
            raise ValueError(f"{path}: models_from must name an experiment with rows of its own; {source!r} takes "
                             "its rows from another")
        rows = load_experiment(source, quick, path.parent)  # a missing one: its own error, naming it
        data = {**data, "variants": rows.variants, "extra_models": rows.extra_models}
    if quick:  # base merges field by field at every level, the other MERGED sections at the top; the rest is replaced
        full, changes = data, data.get("quick") or {}
        data = {**full, **changes}
        for key in MERGED:
            if key in changes:
                old = full.get(key) or {}
                data[key] = merge(old, changes[key]) if key == "base" else {**old, **changes[key]}
    return Experiment.from_dict(data)


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run of a train experiment: where its numbers go in the table, and its config."""

    run_id: str
    model: str  # the table's row: the variant or the extra model's label
    panel: str  # the plot panel / column group ("" when there is one)
    task: str  # the task label
    seed: int
    config: TrainConfig

    def x_of(self, length: int, exp: Experiment) -> float:
        return float(length) if exp.x_axis == "length" else float(exp.tasks[self.task].x)

    def setting(self, length: int, exp: Experiment) -> str:
        """The table's column of this run's result at `length`: `panel/x`, or `x` alone."""
        x = self.x_of(length, exp)
        label = f"{x:g}"
        return f"{self.panel}/{label}" if self.panel else label


def expand(exp: Experiment) -> list[Run]:
    """Every training run of a train experiment, in the order they are run (the slowest variants first, so that
    the parallel workers finish together)."""
    sizes = exp.sizes or {"": {}}
    runs = []
    for label, model in exp.models.items():
        for size_label, size in sizes.items():
            for task_label, task in exp.tasks.items():
                for seed in exp.seeds:
                    panel_parts = ([size_label] if len(sizes) > 1 else []) + (
                        [task_label] if exp.x_axis == "length" and len(exp.tasks) > 1 else [])
                    run_id = "-".join(p for p in (label.replace(" ", "-"), size_label, task_label, f"s{seed}") if p)
                    train_length, eval_lengths = exp.lengths_of(task)
                    data = merge(exp.base, size)
                    data = merge(data, exp.variant_overrides.get(model["variant"], {}))
                    data = merge(data, {
                        "name": run_id, "model": model, "seed": seed,
                        "task": {"name": task.name, "options": task.options, "train_length": train_length,
                                 "eval_lengths": eval_lengths},
                        "time_budget_s": exp.time_budget_s, "threads": 1, "tensorboard": False})
                    try:
                        cfg = load_train_config(data=data)
                    except ValueError as err:
                        raise ValueError(f"experiment {exp.name}, run {run_id}: {err}") from None
                    runs.append(Run(run_id, label, "/".join(panel_parts), task_label, seed, cfg))
    ids = [run.run_id for run in runs]
    clashes = sorted({i for i in ids if ids.count(i) > 1})
    if clashes:  # e.g. an extra model "lmm depth1" beside a size "depth1" of lmm: two runs, one directory
        raise ValueError(f"experiment {exp.name}: runs {clashes} would share a directory; rename a label")
    slow_first = {v: i for i, v in enumerate(("titans_pytorch_mac", "mac", "mag", "mal", "lmm", "gated_deltanet",
                                               "transformer", "swa", "lstm"))}
    return sorted(runs, key=lambda r: slow_first[r.config.model.variant])
