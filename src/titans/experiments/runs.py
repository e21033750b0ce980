"""A grid's runs, shared by every kind of experiment (`runner`'s train grids, `measure`'s capacity and efficiency
measurements, `continual`'s readings of trained models): what makes two configs the same run, training one run
(resumably, or read back finished), calling many side by side, caching a measurement, and the records and per-seed
means a results JSON holds. Nothing here knows which experiment it serves; `runner` dispatches a grid to the module
of its kind, and each of them builds on this one.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, NamedTuple

from ..io.state import staged_writes
from ..models.config import unread_fields, without_fields
from ..train.config import TrainConfig, saved_train_dict
from .spec import Run


def _identity(cfg: TrainConfig) -> dict[str, Any]:
    """What makes two configs the same run: everything but the time budget, which limits a run without being one of
    its settings, the name, which labels it (the directory and the row it is filed under), and the model's fields
    that it never reads (`unread_fields`)."""
    identity = {key: value for key, value in cfg.to_dict().items() if key not in ("time_budget_s", "name")}
    identity["model"] = without_fields(identity["model"], unread_fields(cfg.model))
    return identity


def identity_key(cfg: TrainConfig) -> str:
    return json.dumps(_identity(cfg), sort_keys=True)


def _run_of(cfg: TrainConfig, run_dir: Path) -> tuple[TrainConfig, dict[str, Any] | None] | None:
    """(the saved config, its eval.json or None while unfinished) where `run_dir` holds a run of `cfg`, else None.
    A run of `cfg` has the same `_identity` (a run that met its steps under one budget is the run of any other)."""
    from ..train.checkpoint import load_checkpoint_config

    if not (run_dir / "config.yaml").is_file():
        return None
    try:
        saved = load_checkpoint_config(run_dir)
    except ValueError:
        return None
    if _identity(saved) != _identity(cfg):
        return None
    result = run_dir / "eval.json"
    return saved, json.loads(result.read_text()) if result.is_file() else None


def _cut_short_by_another_budget(cfg: TrainConfig, saved: TrainConfig, summary: dict[str, Any]) -> bool:
    """A finished run that its time budget stopped before its steps, under a budget other than `cfg`'s: under this one
    it would have trained on, so it is continued, not read back."""
    return summary["step"] < cfg.steps and saved.time_budget_s != cfg.time_budget_s


def finished(cfg: TrainConfig, run_dir: Path) -> dict[str, Any] | None:
    """The run's eval.json where `run_dir` holds a finished run of `cfg`, else None."""
    run = _run_of(cfg, run_dir)
    if run is None or run[1] is None or _cut_short_by_another_budget(cfg, *run):
        return None
    return run[1]


def resumable(cfg: TrainConfig, run_dir: Path) -> bool:
    """Whether `run_dir` holds a run of `cfg` to continue: unfinished (a killed grid), or cut short by another time
    budget."""
    run = _run_of(cfg, run_dir)
    return run is not None and (run[1] is None or _cut_short_by_another_budget(cfg, *run))


def train_one(cfg: TrainConfig, run_dir: Path, retrain: bool = False) -> dict[str, Any]:
    """Train `cfg` into `run_dir` unless it is already done there: continue an unfinished run of the same config,
    replace anything else (everything, with `retrain`); return the run's eval.json."""
    from ..train import train

    done = None if retrain else finished(cfg, run_dir)
    if done is None:
        resume = not retrain and resumable(cfg, run_dir)
        train(cfg, run_dir, quiet=True, resume=resume, force=run_dir.exists() and not resume)
        done = json.loads((run_dir / "eval.json").read_text())
    return done


def _train_or_error(cfg: TrainConfig, run_dir: Path, retrain: bool = False) -> dict[str, Any]:
    """`train_one`, with a failure returned as {"error": ...} so that one bad run does not stop the grid."""
    try:
        return train_one(cfg, run_dir, retrain)
    except (ValueError, RuntimeError, MemoryError, OSError) as err:
        return {"error": f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"}


def cached(path: Path, function: Callable[..., Any], *args: Any, refresh: bool = False) -> Any:
    """`function(*args)`, or the result stored at `path` by an earlier call with the same arguments (not with
    `refresh`): measurements resume like training runs. A result with a failed `status` is not stored, so that a
    rerun tries again."""
    key = json.dumps(args, sort_keys=True, default=str)
    if path.is_file() and not refresh:
        try:
            saved = json.loads(path.read_text())
        except ValueError:
            saved = {}
        if saved.get("key") == key:
            return saved["result"]
    result = function(*args)
    if not (isinstance(result, dict) and result.get("status", "ok") != "ok"):
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged_writes(path) as (partial,):
            partial.write_text(json.dumps({"key": key, "result": result}))
    return result


class Point(NamedTuple):
    """One point of a measuring grid (`measure`'s capacity and efficiency): its run id in the results JSON, `spec`
    (everything its value depends on: the settings, the model's or the memory rule's config with every default
    spelled out, the machine where it is a timing), and the call that measures it, `(cache path, function, *args)`
    for `cached`."""

    run_id: str
    spec: dict[str, Any]
    call: tuple[Any, ...]
    measurable: bool = True  # False: read back or shown stale only (what would measure it is not installed here)


@dataclass(frozen=True)
class Measuring:
    """How a measuring grid treats its points: the results JSON it reads them back from, whether it measures those it
    cannot read back (False: `--no-train`, which shows them stale instead) or every point again (`refresh`:
    `--retrain`), how many at a time, and whether it prints a line per point."""

    recorded: Path | None = None
    measure: bool = True
    refresh: bool = False
    jobs: int = 1
    quiet: bool = False


def measure_points(points: list[Point], records: dict[str, Any], recorded_spec: Callable[[dict[str, Any]], Any],
                   keys: tuple[str, ...], describe: Callable[[Any], str],
                   how: Measuring) -> tuple[dict[str, dict[str, Any]], dict[str, list[str]]]:
    """(the points {run id: result}, the stale ones {run id: what changed since}). A point that the results JSON's
    `records` hold measured with exactly its spec (`recorded_spec(record)`, the spec a record was measured under,
    rebuilt for a record from before records kept one) is read back (its `keys`); the others are measured (each
    kept in its cache path) or, where `how` does not measure, shown from their record under another spec and marked
    stale, as a training grid marks a run trained under another config. A point with neither is left out (pending).
    A failed record (its status not ok) is measured again, as a failed training run is trained again. `how.refresh`
    measures every point again, whatever the JSON and the caches hold."""
    results: dict[str, dict[str, Any]] = {}
    stale: dict[str, list[str]] = {}
    todo = []
    for point in points:
        record = records.get(point.run_id)
        saved = recorded_spec(record) if isinstance(record, dict) and record.get("status", "ok") == "ok" else None
        if saved == point.spec and not how.refresh:
            results[point.run_id] = {key: record[key] for key in keys if key in record}
        elif how.measure and point.measurable:
            todo.append(point)
        elif saved is not None:
            results[point.run_id] = {key: record[key] for key in keys if key in record}
            stale[point.run_id] = config_changes(saved, point.spec)
    measured = run_parallel(functools.partial(cached, refresh=how.refresh), [point.call for point in todo],
                            [point.run_id for point in todo], how.jobs, describe, how.quiet)
    results.update({point.run_id: result for point, result in zip(todo, measured)})
    return {point.run_id: results[point.run_id] for point in points if point.run_id in results}, stale


def run_parallel(function: Callable[..., Any], calls: list[tuple[Any, ...]], labels: list[str], jobs: int,
                 describe: Callable[[Any], str], quiet: bool = False,
                 on_result: Callable[[int, Any], None] | None = None) -> list[Any]:
    """`function(*call)` for every call, `jobs` processes at a time (in this process when jobs is 1), printing one
    line per finished call and handing each result to `on_result(index, result)` as it comes; results in the order
    of `calls`."""
    results: list[Any] = [None] * len(calls)
    start = time.perf_counter()

    def report(i: int, done: int) -> None:
        if on_result is not None:
            on_result(i, results[i])
        if not quiet:
            print(f"[{done}/{len(calls)} {time.perf_counter() - start:6.0f} s] {labels[i]}: {describe(results[i])}",
                  flush=True)

    if jobs == 1:
        for i, call in enumerate(calls):
            results[i] = function(*call)
            report(i, i + 1)
        return results
    with ProcessPoolExecutor(jobs, mp_context=get_context("spawn"), initializer=one_thread) as pool:
        futures = {pool.submit(function, *call): i for i, call in enumerate(calls)}
        for done, future in enumerate(as_completed(futures), 1):
            i = futures[future]
            results[i] = future.result()
            report(i, done)
    return results


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def describe_run(summary: dict[str, Any], metric: str = "loss") -> str:
    """A finished run's progress line: its steps, seconds and `metric` at each evaluation length (the loss where the
    evaluation has no such metric)."""
    if "error" in summary:
        return summary["error"]
    results = summary["results"].values()
    name = metric if all(metric in m for m in results) else "loss"
    values = ", ".join(f"{length}: {m[name]:.3f}" for length, m in summary["results"].items())
    return f"{summary['step']} steps in {summary['train_seconds']:.0f} s; {name} {values}"


def add_setting(panels: dict[str, dict[str, Any]], panel: str, setting: str, x: float, **keys: Any) -> None:
    """Put `setting` (at `x`) in its panel's columns the first time it is seen, in order of appearance; `keys` are
    the panel's own (`x_label`, `positions_of`)."""
    entry = panels.setdefault(panel, {"settings": [], "x": [], **keys})
    if setting not in entry["settings"]:
        entry["settings"].append(setting)
        entry["x"].append(x)


# eval.json's record of how training went beyond its loss (each absent from runs trained before it was kept): the
# largest gradient norm before clipping and its step, the share of learned θ_t the momentum-gain bound lowered, and
# for another implementation's model (models/peer.py) its package, version and options
TRAINING_KEYS = ("peak_grad_norm", "peak_grad_step", "momentum_bound_share", "implementation")


def run_record(run: Run, summary: dict[str, Any], values: dict[str, float | None]) -> dict[str, Any]:
    """The JSON's record of one training run: where it sits in the grid, its config, its values and how it trained
    (or its error), with its whole evaluation so that a later run of the grid can read it back (`recorded_runs`)."""
    return {"model": run.model, "panel": run.panel, "task": run.task, "seed": run.seed,
            "config": run.config.to_dict(), "values": values,
            **({"error": summary["error"]} if "error" in summary else {
                "num_parameters": summary["num_parameters"], "steps": summary["step"],
                "seconds": round(summary["train_seconds"], 1), "skipped_steps": summary.get("skipped_steps", 0),
                **{key: summary[key] for key in TRAINING_KEYS if key in summary},
                **({"machine": summary["machine"]} if summary.get("machine") else {}),
                "evaluation": summary["results"]})}


def json_data(path: Path | None) -> dict[str, Any]:
    """The results JSON at `path`; empty where there is none, or it is not one (`titans experiment report` names what
    is wrong with such a file)."""
    try:
        data = json.loads(path.read_text()) if path is not None and path.is_file() else {}
    except ValueError:
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("runs", {}), dict) else {}


def json_records(path: Path) -> tuple[dict[str, Any], str | None]:
    """(the run records, the machine) of the results JSON at `path`; none where there is no results JSON there."""
    data = json_data(path)
    return dict(data.get("runs", {})), data.get("machine")


def config_changes(saved: dict[str, Any], grid: dict[str, Any], prefix: str = "") -> list[str]:
    """'field: recorded → the grid's' for every field where a recorded config differs from the grid's."""
    changes = []
    for key in sorted(set(saved) | set(grid)):
        old, new = saved.get(key), grid.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += config_changes(old, new, f"{prefix}{key}.")
        elif old is None and isinstance(new, dict):  # a section the record does not hold (from before it kept one)
            changes.append(f"{prefix}{key}: not recorded")
        elif old != new:
            changes.append(f"{prefix}{key}: {json.dumps(old)} → {json.dumps(new)}")
    return changes


def recorded_config(record: Any) -> TrainConfig | None:
    """The config a finished record was trained with; None for a failed record or one without a readable config.
    Read as a config: a field added since is at its default (or at its earlier one, where the default changed)."""
    if not isinstance(record, dict) or "error" in record or not isinstance(record.get("config"), dict):
        return None
    try:
        return TrainConfig.from_dict(saved_train_dict(record["config"]))
    except ValueError:
        return None


def collect(per_seed: dict[str, dict[str, list[float | None]]], row: str, values: dict[str, float | None]) -> None:
    """Add one run's `values` to its row's values per setting (one per seed)."""
    for setting, value in values.items():
        per_seed.setdefault(row, {}).setdefault(setting, []).append(value)


def over_seeds(per_seed: dict[str, dict[str, list[float | None]]]) -> dict[str, Any]:
    """{"results": the mean over a row's runs (its seeds) of every setting, "spread": their [min, max]}."""
    return {"results": {m: {s: mean(v) for s, v in by_setting.items()} for m, by_setting in per_seed.items()},
            "spread": {m: {s: spread_of(v) for s, v in by_setting.items()} for m, by_setting in per_seed.items()}}


def mean(values: list[float | None]) -> float | None:
    """The mean of the runs that finished; None when none did."""
    done = [v for v in values if v is not None]
    return sum(done) / len(done) if done else None


def spread_of(values: list[float | None]) -> list[float] | None:
    done = [v for v in values if v is not None]
    return [min(done), max(done)] if done else None
