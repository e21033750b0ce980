"""`titans demo`: a Titans model against the sliding-window baseline on a needle task, 1-8x the training length.

Each config in configs/demo/ is trained (time-boxed by its `time_budget_s`), evaluated at the lengths
of its task, and the results go to a table (stdout), a PNG plot and a JSON file:
`{"task": ..., "train_length": L, "results": {"<model name>": {"<length>": accuracy, ...}, ...}}`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from .config import TrainConfig, load_train_config
from .loop import train


def default_demo_configs() -> list[Path]:
    for root in (Path.cwd(), Path(__file__).resolve().parents[3]):
        found = sorted((root / "configs" / "demo").glob("*.yaml"))
        if found:
            return found
    raise ValueError("no demo configs found (configs/demo/*.yaml); pass --configs")


def plot_results(results: dict[str, dict[str, float]], train_length: int, window: Optional[int], task: str,
                 path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, by_length in results.items():
        lengths = [int(k) for k in by_length]
        ax.plot(lengths, list(by_length.values()), marker="o", label=name)
    ax.axvline(train_length, color="grey", linestyle=":", label=f"train length {train_length}")
    if window:
        ax.axvline(window, color="red", linestyle="--", alpha=0.5, label=f"attention window {window}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("exact-match accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"{task}: accuracy vs context length")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_table(results: dict[str, dict[str, float]]) -> str:
    lengths = sorted({int(k) for by_length in results.values() for k in by_length})
    lines = ["| model | " + " | ".join(str(n) for n in lengths) + " |", "|---|" + "---:|" * len(lengths)]
    for name, by_length in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{by_length.get(str(n), float('nan')):.3f}" for n in lengths) + " |")
    return "\n".join(lines)


def run_demo(out: Path, config_paths: Optional[list[Path]] = None, quiet: bool = False) -> Path:
    configs: list[TrainConfig] = [load_train_config(p) for p in (config_paths or default_demo_configs())]
    tasks = {(c.task.name, c.task.train_length) for c in configs}
    if len(tasks) != 1:
        raise ValueError(f"demo configs must share one task and training length, got {sorted(tasks)}")
    task, train_length = tasks.pop()
    results, details = {}, {}
    for cfg in configs:
        run = train(cfg, out / cfg.run_name, quiet=quiet)
        results[cfg.run_name] = {str(k): v["accuracy"] for k, v in run.evaluation.items()}
        details[cfg.run_name] = {"variant": cfg.model.variant, "steps": run.step, "train_seconds": run.seconds,
                                 "window": cfg.model.window, "final_train_loss": run.final_loss}
        print(f"{cfg.run_name}: {run.step} steps in {run.seconds:.0f} s, "
              f"accuracy {results[cfg.run_name]}", flush=True)
    windows = {c.model.window for c in configs if c.model.variant in ("swa", "mag", "mal")}
    print(format_table(results), flush=True)
    plot_results(results, train_length, min(windows) if windows else None, task, out / "demo.png")
    result_path = out / "demo.json"
    result_path.write_text(json.dumps({"task": task, "train_length": train_length, "results": results,
                                       "runs": details, "plot": str(out / "demo.png")}, indent=2))
    return result_path
