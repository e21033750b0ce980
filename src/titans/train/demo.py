"""`titans demo`: a Titans model against the sliding-window baseline on a needle task, 1-8x the training length.

Each config in configs/demo/ is trained (time-boxed by its `time_budget_s`), evaluated at the lengths
of its task, and the results go to a table (stdout), a PNG plot and a JSON file:
`{"task": ..., "train_length": L, "results": {"<model name>": {"<length>": accuracy, ...}, ...}}`.

The runs go side by side, one process each, with the cores split between them: the models are
small, so one thread per run on two cores is faster than two threads on one run after the other.
Each run shows its progress bar; the CPU kernels are built (first use only) before any training starts,
so that their build is not training time, and the wall time of the whole demo is printed and kept.
"""

from __future__ import annotations

import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from functools import partial
from multiprocessing import get_context
from pathlib import Path

from ..config import shipped_configs
from .checkpoint import check_run_dir, prepare_run_dir
from .config import load_train_config
from .loop import checked_tasks, resolve_device, train


def default_demo_configs() -> list[Path]:
    """configs/demo/*.yaml in the working directory, else in the source checkout this package runs from."""
    folder = shipped_configs("demo")
    if folder is None:
        raise ValueError("no demo configs found (configs/demo/*.yaml); pass --configs")
    return sorted(folder.glob("*.yaml"))


def plot_results(results: dict[str, dict[str, float]], train_length: int, window: int | None, task: str,
                 path: Path) -> None:
    """Accuracy against context length, one line per model, the training length marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = sorted({int(k) for by_length in results.values() for k in by_length})
    for name, by_length in results.items():
        ax.plot([int(k) for k in by_length], list(by_length.values()), marker="o", label=name)
    ax.axvline(train_length, color="grey", linestyle=":", label=f"training length {train_length}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{task}: accuracy vs context length" + (f" (attention window {window})" if window else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A markdown table: one row per model, one column per length."""
    lengths = sorted({int(k) for by_length in results.values() for k in by_length})
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name, by_length in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_length.get(str(n), float('nan')):.3f}" for n in lengths) + " |")
    return "\n".join(lines)


def _train_with_bar(cfg, run_dir: Path, position: int, quiet: bool):
    """One demo run in its own process, its progress bar on line `position` of the terminal."""
    return train(cfg, run_dir, quiet=quiet, bar_position=position)


def build_kernels(configs: list) -> None:
    """Build (or load from the cache) the memory's CPU kernels once, before the runs start, where a run needs them:
    on a fresh clone that takes a minute, which is neither training time nor a per-process cost."""
    if not any(c.model.variant not in ("transformer", "swa", "lstm") and c.device in ("cpu", "auto") for c in configs):
        return
    from ..memory.state_ops import kernels

    start = time.perf_counter()
    kernels()
    print(f"CPU kernels ready in {time.perf_counter() - start:.0f} s (built on first use, cached after)",
          file=sys.stderr, flush=True)


def run_demo(out: Path, config_paths: list[Path] | None = None, jobs: int | None = None,
             quiet: bool = False, force: bool = False) -> Path:
    """Train every config into out/<name>, write out/demo.json and out/demo.png; return the JSON path.

    `out` must be new, or (with `force`) a titans folder, which is replaced once every config has been checked.
    `jobs` runs go at once (default: one per config, at most one per core), each with
    cores // jobs threads unless its config sets `threads`.
    """
    check_run_dir(out, force, resumable=False)
    configs = [load_train_config(p) for p in (config_paths or default_demo_configs())]
    run_dirs = [c.run_dir_in(out) for c in configs]
    names = [c.run_name for c in configs]
    if len(set(names)) != len(names):
        raise ValueError(f"demo configs need distinct names, got {names}")
    tasks = {(c.task.name, c.task.train_length) for c in configs}
    if len(tasks) != 1:
        raise ValueError(f"demo configs must share one task and training length, got {sorted(tasks)}")
    task, train_length = tasks.pop()
    for cfg in configs:  # what each run's trainer checks, before the old output is replaced
        resolve_device(cfg.device)
        if checked_tasks(cfg)[0].vocab_size is None:
            raise ValueError(f"the demo compares exact-match accuracy, which the series task {task} does not have; "
                             "use token tasks (titans train runs any task)")
    prepare_run_dir(out, force, resumable=False)
    build_kernels(configs)
    start = time.perf_counter()
    cores = os.cpu_count() or 1
    jobs = jobs or max(1, min(len(configs), cores))
    configs = [c if c.threads else c.replace(threads=max(1, cores // jobs)) for c in configs]
    if jobs == 1:
        runs = [train(cfg, run_dir, quiet=quiet) for cfg, run_dir in zip(configs, run_dirs)]
    else:
        if not quiet:
            print(f"training {', '.join(names)} side by side ({jobs} processes), then evaluating at "
                  f"1-{max(configs[0].task.eval_lengths) // train_length}x the training length", flush=True)
        positions = [i % jobs for i in range(len(configs))]  # a bar per run on its own line
        with ProcessPoolExecutor(jobs, mp_context=get_context("spawn")) as pool:
            runs = list(pool.map(partial(_train_with_bar, quiet=quiet), configs, run_dirs, positions))
    wall = time.perf_counter() - start
    results, details = {}, {}
    for cfg, run in zip(configs, runs):
        results[cfg.run_name] = {str(k): v["accuracy"] for k, v in run.evaluation.items()}
        details[cfg.run_name] = {"variant": cfg.model.variant, "window": cfg.model.attention.window, "steps": run.step,
                                 "train_seconds": round(run.seconds, 1), "num_parameters": run.num_parameters,
                                 "final_train_loss": run.final_loss}
        short = f" (the time budget stopped it before step {cfg.steps})" if run.step < cfg.steps else ""
        print(f"{cfg.run_name}: {run.num_parameters} parameters, {run.step} steps in {run.seconds:.0f} s{short}, "
              f"final training loss {run.final_loss:.3f}", flush=True)
    windows = {c.model.attention.window for c in configs if c.model.variant in ("swa", "mag", "mal")}
    print(format_table(results), flush=True)
    print(f"demo: {wall:.0f} s of training and evaluation (wall clock, {cores} cores, kernels' build aside)",
          flush=True)
    plot_results(results, train_length, min(windows) if windows else None, task, out / "demo.png")
    result_path = out / "demo.json"
    result_path.write_text(json.dumps({"task": task, "train_length": train_length, "results": results,
                                       "runs": details, "wall_seconds": round(wall, 1), "cores": cores,
                                       "plot": str(out / "demo.png")}, indent=2))
    return result_path
