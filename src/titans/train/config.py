"""`TrainConfig`: model + task + optimiser + loop settings, one YAML file per run.

Everything goes through `titans.config.Config` (strict: an unknown field, a wrong type or a value out
of its field's bounds is a ValueError naming its path, `optim.lr`). `load_train_config` reads a YAML
file, applies `a.b=value` overrides, builds the task once to check its name and options, and fills
`model.vocab_size` from the task when the file leaves it out.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import Field, PositiveInt, model_validator

from ..config import Config, FromList, apply_overrides, dotted_fields, read_yaml_mapping
from ..models.config import TitansConfig, nest_flat_fields, with_earlier_defaults
from ..tasks import Task, get_task
from .precision import Precision

# Fields that may change when a run is resumed: they do not touch the weights, the data stream or the
# optimiser's trajectory up to the checkpoint (only how far it goes and what is logged along the way).
# A new `steps` stretches the cosine schedule to the new end from the resumed step on: the learning rate
# continues from where the new schedule stands, not from where the old one was.
RESUMABLE_CHANGES = frozenset({"name", "steps", "time_budget_s", "eval_every", "eval_batches", "eval_batch_size",
                               "eval_piece", "eval_position_buckets",
                               "checkpoint_every", "keep_checkpoints", "log_every", "max_skips_in_row", "device",
                               "threads", "tensorboard", "compile", "task.eval_lengths", "activation_checkpointing"})

# A run's name is the name of its directory (runs/<name>, demo/<name>): one path component that cannot climb out
# of its parent (no separator, no leading dot so neither `.` nor `..`), in characters every filesystem takes.
RUN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")
MAX_SEED = 2**63 - 1  # a signed 64-bit integer: torch.manual_seed and derive_seed (64-bit parts) take it as it is
# torch.set_num_threads crashes the process (segfault) on huge counts; no machine has more cores than this.
MAX_THREADS = 1024
Beta = Annotated[float, Field(ge=0, lt=1)]  # an Adam decay rate


class TaskConfig(Config):
    """Which task to train on (`titans.tasks.get_task(name, **options)`) and at which lengths."""

    name: str = "passkey"
    options: dict[str, Any] = Field(default_factory=dict)
    train_length: int = Field(256, ge=1)
    eval_lengths: list[PositiveInt] = Field(default_factory=lambda: [256, 512, 1024, 2048], min_length=1)


class OptimConfig(Config):
    """AdamW with linear warmup then cosine decay to `lr * min_lr_ratio` at the last step."""

    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.1, ge=0)  # on the matrices of linear/LSTM layers only (see loop.make_optimizer)
    betas: FromList[tuple[Beta, Beta]] = (0.9, 0.95)
    eps: float = Field(1e-8, gt=0)
    warmup_steps: int = Field(50, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    grad_clip: float = Field(1.0, ge=0)  # max global gradient norm; 0 disables clipping
    grad_accum: int = Field(1, ge=1)  # micro-batches per step (the global batch is split into this many)
    # weight decay also on the matrix of the memory's data-dependent gates (θ_t, η_t, α_t from x_t). True: every run
    # trained before this field (they decayed it); the recipes (configs/recipes) set false: decay pulls the gates'
    # weights to zero, to gates that no longer depend on the token, which the paper's gates are meant to.
    decay_gates: bool = True


class TrainConfig(Config):
    """One training run. `batch_size` is the global batch: split over ranks and accumulation steps."""

    model: TitansConfig = Field(default_factory=TitansConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    name: str = ""  # shown in tables, plots and the default run directory; default: the model variant
    steps: int = Field(500, ge=1)
    batch_size: int = Field(16, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)  # model initialisation and the training data stream
    eval_every: int = Field(0, ge=0)  # evaluate at task.train_length every this many steps; 0: only the final one
    eval_batches: int = Field(4, ge=1)
    eval_batch_size: int = Field(16, ge=1)
    # evaluate through the recurrent state, this many tokens per call; None: whole sequences
    eval_piece: Optional[int] = Field(None, ge=1)
    # token tasks: also the mean loss over each of this many equal spans of positions (does a later token cost
    # less?); 0: none
    eval_position_buckets: int = Field(0, ge=0)
    # each batch row reads this many consecutive windows of one sequence (carry_windows x task.train_length), one
    # window a step, the model's recurrent state carried from each window into the next and detached there
    # (truncated backpropagation through time): training then meets memories older than one window, as a stream
    # read past the training length does. 1: every step starts from a fresh state.
    carry_windows: int = Field(1, ge=1)
    checkpoint_every: int = Field(100, ge=0)  # 0: only at the end (or when time_budget_s runs out)
    keep_checkpoints: int = Field(2, ge=1)  # newest checkpoints kept in run_dir/checkpoints
    log_every: int = Field(10, ge=1)
    # stop with an error after this many steps in a row skipped (non-finite loss/gradient)
    max_skips_in_row: int = Field(20, ge=1)
    # stop (and checkpoint) once training took this long; None: no limit
    time_budget_s: Optional[float] = Field(None, gt=0)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    # float32 / float64: parameters and activations in that dtype; bfloat16: bf16 autocast over float32 parameters
    # (the master weights) and a float32 memory state (train/precision.py)
    dtype: Precision = "float32"
    # torch.compile the model's training forward (evaluation runs uncompiled); the memory's chunk loop stays eager
    # (NeuralMemory._memory is torch.compiler.disable'd: its C++ kernels and custom autograd Function do not trace)
    compile: bool = False
    # under torchrun: "ddp" replicates the model on every rank (DistributedDataParallel); "fsdp" shards its parameters,
    # gradients and optimiser state over the ranks (FSDP2, train/fsdp.py; language models; needs torchrun even for one
    # rank) and writes sharded checkpoints
    parallel: Literal["ddp", "fsdp"] = "ddp"
    # recompute each block's activations in the backward pass instead of keeping them (torch.utils.checkpoint): memory
    # for a block's worth of compute; the same gradients
    activation_checkpointing: bool = False
    threads: Optional[int] = Field(None, ge=1, le=MAX_THREADS)  # torch intra-op threads; None: torch's default
    tensorboard: bool = True  # also write run_dir/tensorboard when the tensorboard package is installed

    @model_validator(mode="after")
    def check_rules(self) -> TrainConfig:
        if self.batch_size % self.optim.grad_accum:
            raise ValueError(f"batch_size ({self.batch_size}) must be divisible by optim.grad_accum "
                             f"({self.optim.grad_accum})")
        if self.eval_position_buckets > min(self.task.eval_lengths):
            raise ValueError(f"eval_position_buckets ({self.eval_position_buckets}) must be at most the shortest of "
                             f"task.eval_lengths ({min(self.task.eval_lengths)}): a bucket holds at least one position")
        return self

    @property
    def run_name(self) -> str:
        return self.name or self.model.variant

    def run_dir_in(self, parent: Path) -> Path:
        """parent/<run name>: checked where the name becomes a directory (not in `validate`, so a checkpoint whose
        config carries any name still loads), since `../x` or `/x` would put the run outside `parent`."""
        if not RUN_NAME.fullmatch(self.run_name):
            raise ValueError(f"name must be letters, digits, '-', '_' and '.', not starting with '.' (it names the "
                             f"run directory in {parent}), got {self.run_name!r}; or pick the directory with --out")
        return Path(parent) / self.run_name


def resume_mismatches(saved: TrainConfig, current: TrainConfig) -> list[str]:
    """The dotted fields (`model.dim (16 -> 32)`) in which `current` may not differ from the run it resumes."""
    old, new = (dotted_fields(c.to_dict(), opaque=frozenset({"options"})) for c in (saved, current))
    return [f"{key} ({old.get(key)!r} -> {new.get(key)!r})" for key in sorted(old.keys() | new.keys())
            if key not in RESUMABLE_CHANGES and old.get(key) != new.get(key)]


def saved_train_dict(data: Any) -> Any:
    """A saved TrainConfig's mapping (a checkpoint's config.yaml, a results JSON's record) with the model fields it
    lacks whose default changed since filled with their earlier value (`models.config.EARLIER_DEFAULTS`); the memory's
    and the attention's fields nested where it wrote them flat."""
    if isinstance(data, dict) and isinstance(data.get("model", {}), dict):
        return {**data, "model": with_earlier_defaults(data.get("model", {}))}
    return data


def nested_train_dict(data: Any) -> Any:
    """A TrainConfig mapping with its model's flat fields moved into their sections (`memory`, `attention`;
    `models.config.nest_flat_fields`): what two mappings are made before one is laid over the other (a file and its
    overrides), so that the later wins however either spells a field."""
    if isinstance(data, dict) and isinstance(data.get("model"), dict):
        return {**data, "model": nest_flat_fields(data["model"])}
    return data


def load_train_config(path: str | Path | None = None, overrides: list[str] | None = None,
                      data: dict[str, Any] | None = None) -> TrainConfig:
    """Read a YAML file (or take `data`), apply overrides, check the task, fill `model.vocab_size` from it.

    Overrides are `a.b=value` (value parsed as YAML); top-level fields may also be written with a
    `train.` prefix (`train.steps=10` is `steps=10`).
    """
    if data is None:
        if path is None:
            raise ValueError("a config file path or a data mapping is required")
        data = read_yaml_mapping(path)
    overrides = [item.removeprefix("train.") for item in overrides or []]
    data = apply_overrides(nested_train_dict(data), overrides)
    cfg = TrainConfig.from_dict(data)
    task = get_task(cfg.task.name, **cfg.task.options)
    lengths_of = (("task.train_length", [cfg.task.train_length]), ("task.eval_lengths", cfg.task.eval_lengths))
    for field, lengths in lengths_of:
        if min(lengths) < task.min_length():
            raise ValueError(f"{field} ({min(lengths)}) is shorter than task {task.name} needs "
                             f"({task.min_length()} with its options)")
    recorded = task.recorded_options()
    if recorded is not None and recorded != cfg.task.options:  # e.g. the tokenizer an lm_tokens run trains with
        cfg.task = cfg.task.replace(options=recorded)
    if task.vocab_size is not None and "vocab_size" not in (data.get("model") or {}):
        cfg.model = cfg.model.replace(vocab_size=task.vocab_size)
    check_model_fits_task(cfg.model, task)
    return cfg


def check_model_fits_task(model: TitansConfig, task: Task) -> None:
    """A token task's vocabulary must fit the model's embedding table."""
    if task.vocab_size is not None and model.vocab_size < task.vocab_size:
        raise ValueError(f"model.vocab_size ({model.vocab_size}) is smaller than task {task.name}'s vocabulary "
                         f"({task.vocab_size})")
