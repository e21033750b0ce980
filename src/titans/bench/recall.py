"""Do the default models learn recall beyond their attention window? `titans bench recall`.

Every variant is trained with `TitansConfig`'s defaults (only the sizes below are set: width, blocks, heads,
attention window and MAC segment) on three recall tasks for a fixed number of steps with the project's trainer,
then evaluated at 1×, 4× and 8× the training length on held-out sequences. The memory's own settings (θ_max, the
gates' initialisation, the bounds) are never set here: this measures the defaults.

Runs go to `<run_dir>/<variant>-<task>-s<seed>`; a run whose directory already holds its result for the same config
is not trained again, and an unfinished one continues from its checkpoint (`experiments.runs.train_one`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..train.config import TrainConfig, load_train_config


@dataclass(frozen=True)
class RecallTask:
    options: dict[str, Any]
    metric: str  # the evaluation metric reported: "accuracy" (the row's answer) or "token_accuracy" (each query)
    about: str


TASKS: dict[str, RecallTask] = {
    "passkey": RecallTask({"vocab": 64, "num_values": 16}, "accuracy",
                          "one (KEY, value) needle at a random depth in noise, asked at the end; chance 1/16"),
    "mqar": RecallTask({"vocab": 128, "num_pairs": 8}, "token_accuracy",
                       "8 key-value pairs, then every key asked once at power-law distances; per-query accuracy, "
                       "chance 1/63"),
    "kv_recall": RecallTask({"vocab": 64, "num_pairs": 4}, "accuracy",
                            "4 key-value pairs, then noise, then one key asked at the end; chance 1/16"),
}
MULTIPLES = (1, 4, 8)
SIZES = {"dim": 64, "depth": 2, "heads": 2, "window": 32, "segment_len": 32}


def recall_config(variant: str, task: str, seed: int, steps: int, train_length: int,
                  overrides: list[str] | None = None) -> TrainConfig:
    """The run's config; `overrides` (`model.memory.init_eta=0.5`, as `titans train` takes them) change the defaults
    being measured, to compare a design choice with the default in runs that differ in nothing else."""
    return load_train_config(overrides=overrides, data={
        "name": f"{variant}-{task}-s{seed}",
        "model": {"variant": variant, **SIZES},
        "task": {"name": task, "options": TASKS[task].options, "train_length": train_length,
                 "eval_lengths": [m * train_length for m in MULTIPLES]},
        "optim": {"lr": 2e-3, "warmup_steps": 50, "weight_decay": 0.0},
        "steps": steps, "batch_size": 32, "seed": seed, "eval_batches": 4, "eval_batch_size": 64,
        "checkpoint_every": 0, "log_every": 50, "threads": 1, "tensorboard": False,
    })


def collect(cfg: TrainConfig, summary: dict[str, Any]) -> dict[str, Any]:
    """One run's row: the task's metric at each multiple of the training length, and how the run went."""
    metric = TASKS[cfg.task.name].metric
    train_length = cfg.task.train_length
    return {
        "variant": cfg.model.variant, "task": cfg.task.name, "seed": cfg.seed, "metric": metric,
        "accuracy": {f"{m}x": summary["results"][str(m * train_length)][metric] for m in MULTIPLES},
        "skipped_steps": summary.get("skipped_steps", 0), "steps": summary["step"],
        "train_seconds": round(summary["train_seconds"], 1), "num_parameters": summary["num_parameters"],
    }


def format_table(rows: list[dict[str, Any]], tasks: list[str]) -> str:
    """Markdown: one row per variant, per task the metric at 1×, 4×, 8× (mean over seeds)."""
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    header = "| variant | " + " | ".join(f"{t} {m}x" for t in tasks for m in MULTIPLES) + " |"
    lines = [header, "|---|" + "---:|" * (len(tasks) * len(MULTIPLES))]
    for variant in variants:
        cells = []
        for task in tasks:
            mine = [r for r in rows if r["variant"] == variant and r["task"] == task]
            for m in MULTIPLES:
                values = [r["accuracy"][f"{m}x"] for r in mine]
                cells.append(f"{sum(values) / len(values):.2f}" if values else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
