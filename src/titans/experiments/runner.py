"""`titans experiment run`: run an experiment's grid, resumably and side by side, and write its results JSON.

Every training run goes to `<runs>/<experiment>/<run id>`. A run whose directory holds a finished run of exactly its
config is read back, not trained again; an unfinished one (killed) continues from its last checkpoint; one of another
config is replaced. Runs go `jobs` at a time, one process and one torch thread each. A run that fails (a config the
machine cannot hold, too many skipped steps) is recorded with its error and a null result; the rest go on.

The results JSON is also the grid's ledger: it is rewritten after every finished run (with the runs still to come
under "pending"), and a run it records, finished, with exactly the config of the grid's run (up to the time budget),
is read back from it, not trained again. So a grid continues from a committed JSON on a fresh clone, where the runs
directory is gone: adding a seed to an experiment trains the new seed only. `retrain` trains every run again (after a
change to the model's code, which no config shows).

The results JSON (`docs/results/<experiment>.json`) holds everything the report needs:

    {"experiment", "title", "about", "discussion", "tier", "command", "machine" (that trained most of the runs),
     "metric", "higher_is_better",
     "x_label", "x_axis", "published" (others' figures for the same experiment, or null), "heatmap" (or null),
     "baselines" ({"<row>": "<metric>"}: rows that are no model, or null),
     "panels": {"<panel>": {"settings": [...], "x": [...], and a panel's own "x_label", "higher_is_better",
                            "positions_of" (the setting a panel against position in the context splits)}},
     "results": {"<model>": {"<setting>": value (the mean over seeds), ...}, ...} (baseline rows: the mean over the
                 runs of the metric they report for it),
     "spread": {"<model>": {"<setting>": [min, max] over seeds}},
     "second": {"metric", "results", "spread"} (the experiment's `second_metric`, as "results" and "spread" hold
                 the headline metric; only where it has one),
     "runs": {"<run id>": {"model", "panel", "task", "seed", "config", "num_parameters", "steps", "seconds",
                           "skipped_steps", "machine", "values": {"<setting>": value},
                           "implementation"? (another implementation's {"package", "version", "class", "options"}),
                           "evaluation": {"<length>": {every metric its evaluation reported}}, "error"?}},
     "pending": [run ids not finished yet] (only while the grid is incomplete)}
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from ..io.state import staged_writes
from ..train.config import TrainConfig
from ..train.loop import checked_tasks
from .runs import (
    TRAINING_KEYS,
    Measuring,
    _identity,
    _train_or_error,
    add_setting,
    collect,
    config_changes,
    describe_run,
    identity_key,
    json_records,
    over_seeds,
    recorded_config,
    run_parallel,
    run_record,
)
from .spec import Experiment, Run, expand

POSITION_LABEL = "position in the context (end of each span)"


def train_results(exp: Experiment, runs: list[Run], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The JSON's panels, results, spread and runs from the runs' eval.json summaries. Where a run's evaluation kept
    the metric per span of positions (`eval_position_buckets`), each evaluation length adds a panel of it against
    position (`positions_of` names the setting it splits)."""
    panels: dict[str, dict[str, Any]] = {}
    per_seed: dict[str, dict[str, list[float | None]]] = {}
    second: dict[str, dict[str, list[float | None]]] = {}  # exp.second_metric's, setting by setting
    records = {}
    for run, summary in zip(runs, summaries):
        values = {}
        for length in run.config.task.eval_lengths:
            setting = run.setting(length, exp)
            add_setting(panels, run.panel, setting, run.x_of(length, exp))
            metrics = {} if "error" in summary else summary["results"][str(length)]
            values[setting] = None if "error" in summary else metrics[exp.metric]
            collect(per_seed, run.model, {setting: values[setting]})
            if exp.second_metric:  # None where a record rebuilt from its values lacks it
                collect(second, run.model, {setting: metrics.get(exp.second_metric)})
            for label, metric in exp.baselines.items():
                collect(per_seed, label, {setting: None if "error" in summary else
                                          baseline_value(metrics, label, metric, run.run_id)})
            for end, value in zip(metrics.get("position_ends", []), metrics.get(f"{exp.metric}_by_position", [])):
                panel = ", ".join(filter(None, (run.panel, f"{exp.metric} by position at {length:g}")))
                add_setting(panels, panel, f"{panel}/{end}", float(end), x_label=POSITION_LABEL, positions_of=setting)
                values[f"{panel}/{end}"] = value
                collect(per_seed, run.model, {f"{panel}/{end}": value})
        records[run.run_id] = run_record(run, summary, values)
    machine = trained_on(summaries)
    shown = {"second": {"metric": exp.second_metric, **over_seeds(second)}} if exp.second_metric else {}
    return {**({"machine": machine} if machine else {}), "panels": panels, **over_seeds(per_seed), **shown,
            "runs": records}


def trained_on(summaries: list[dict[str, Any]]) -> str | None:
    """The machine that trained most of the runs (the JSON's "machine"): not the one that merely rewrote the JSON,
    which `--no-train` or a grid finished elsewhere would otherwise claim; None where no run names its machine."""
    machines = Counter(s["machine"] for s in summaries if s.get("machine"))
    return machines.most_common(1)[0][0] if machines else None


def recorded_runs(records: dict[str, Any], machine: str | None, exp: Experiment,
                  runs: list[Run]) -> dict[str, dict[str, Any]]:
    """{run id: its eval.json summary} for the runs of `runs` that a results JSON's `records` hold finished with
    exactly their config (their `_identity`, as `finished` reads a run directory), so that they are not trained
    again. A run is read back from its own record or, failing that, from any record of the same config: a row
    renamed, or a default changed so that one row's config is now another's, reuses the measurement. A record cut
    short by a time budget other than the grid's is not read back (it would train on); nor is one that failed. A
    record from before records kept their evaluation is rebuilt from its values."""
    by_identity: dict[str, list[tuple[str, TrainConfig, dict[str, Any]]]] = {}
    for run_id, record in records.items():
        saved = recorded_config(record)
        if saved is None:
            continue
        by_identity.setdefault(identity_key(saved), []).append((run_id, saved, record))
    known = {}
    for run in runs:
        same = by_identity.get(identity_key(run.config), [])
        for _, saved, record in sorted(same, key=lambda found: found[0] != run.run_id):  # its own record first
            if record["steps"] < run.config.steps and saved.time_budget_s != run.config.time_budget_s:
                continue
            summary = summary_of(record, run, exp, machine)
            if summary is not None:
                known[run.run_id] = summary
                break
    return known


def earlier_runs(records: dict[str, Any], machine: str | None, exp: Experiment,
                 runs: list[Run]) -> dict[str, tuple[dict[str, Any], dict[str, Any], list[str]]]:
    """{run id: (its recorded config, its summary, the fields the grid has changed since)} for the runs of `runs`
    that a results JSON's `records` hold finished under another config (a default or the grid changed since): shown,
    and marked stale, until they are trained again."""
    found = {}
    for run in runs:
        record = records.get(run.run_id)
        saved = recorded_config(record)
        if saved is None:
            continue
        changes = config_changes(_identity(saved), _identity(run.config))
        summary = summary_of(record, run, exp, machine)
        if changes and summary is not None:
            found[run.run_id] = (record["config"], summary, changes)
    return found


def summary_of(record: dict[str, Any], run: Run, exp: Experiment, machine: str | None) -> dict[str, Any] | None:
    """A finished record read back as the eval.json summary of its run (`machine`: the JSON's, where the record
    names none); None where its evaluation cannot be rebuilt."""
    evaluation = record.get("evaluation") or evaluation_from_values(record["values"], run, exp)
    if evaluation is None:
        return None
    return {"results": evaluation, "num_parameters": record["num_parameters"], "step": record["steps"],
            "train_seconds": record["seconds"], "skipped_steps": record.get("skipped_steps", 0),
            **{key: record[key] for key in TRAINING_KEYS if key in record},
            "machine": record.get("machine", machine)}


def evaluation_from_values(values: dict[str, float | None], run: Run, exp: Experiment) -> dict[str, Any] | None:
    """A run's evaluation (the metric at each length, and by position where it was kept) rebuilt from the values a
    record holds; None where the experiment needs more than those (a baseline row reads other metrics)."""
    if exp.baselines:
        return None
    evaluation = {}
    for length in run.config.task.eval_lengths:
        setting = run.setting(length, exp)
        if setting not in values:
            return None
        metrics: dict[str, Any] = {exp.metric: values[setting]}
        panel = ", ".join(filter(None, (run.panel, f"{exp.metric} by position at {length:g}")))
        ends = [key[len(panel) + 1:] for key in values if key.startswith(panel + "/")]
        if ends:
            metrics["position_ends"] = [int(end) if end.isdigit() else float(end) for end in ends]
            metrics[f"{exp.metric}_by_position"] = [values[f"{panel}/{end}"] for end in ends]
        evaluation[str(length)] = metrics
    return evaluation


def baseline_value(metrics: dict[str, float], label: str, metric: str, run_id: str) -> float:
    if metric not in metrics:
        raise ValueError(f"baseline {label!r} reads {metric!r}, which run {run_id}'s evaluation does not report (it "
                         f"reports {', '.join(metrics)})")
    return metrics[metric]


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def grid_words(exp: Experiment) -> dict[str, str]:
    """The grid's prose as its JSON holds it (title, about, discussion; whitespace folded): written from the YAML at
    every run, read by the report, and compared with the YAML by the tests, one definition for all three."""
    return {"title": exp.title or exp.name, "about": " ".join(exp.about.split()),
            "discussion": " ".join(exp.discussion.split())}


def run_experiment(exp: Experiment, results_dir: Path, runs_dir: Path, jobs: int | None = None,
                   quick: bool = False, quiet: bool = False, retrain: bool = False,
                   only: list[str] | None = None) -> Path:
    """Run `exp` (resumably) and write `<results_dir>/<name>.json`; return its path. `retrain` trains (or measures)
    every run again, whatever the runs directory and the JSON hold; `only` (the rows of a train experiment) trains
    those rows' runs alone, the others staying as the JSON has them or pending; `only=[]` trains and measures
    nothing, rewriting the JSON from what it and the runs directory hold (a run or point under an earlier config
    marked stale)."""
    from ..machine import describe_machine
    from . import continual, measure

    if only and exp.kind != "train":  # before anything is written
        raise ValueError(f"--only is for a training grid; {exp.name} is a {exp.kind} experiment")
    jobs = jobs or default_jobs()
    results_dir.mkdir(parents=True, exist_ok=True)
    header = {"experiment": exp.name, **grid_words(exp), "tier": "quick" if quick else "full", "kind": exp.kind,
              "command": "titans experiment run " + exp.name + (" --quick" if quick else ""),
              "machine": describe_machine(), "metric": exp.metric, "higher_is_better": exp.higher_is_better,
              "x_label": exp.x_label, "x_axis": exp.x_axis, "compare": [list(pair) for pair in exp.compare],
              "published": exp.published.to_dict() if exp.published.values else None,
              "baselines": dict(exp.baselines) or None,
              "heatmap": exp.heatmap.to_dict() if exp.heatmap.x else None}
    path = results_dir / f"{exp.name}.json"
    if exp.kind == "train":
        body = train_grid(exp, path, runs_dir, jobs, header, quiet, retrain, only)
    elif exp.kind == "continual":
        body = continual.continual_results(exp, runs_dir, jobs, quick, quiet, recorded=None if retrain else path,
                                           measure=only is None)
    elif exp.kind == "capacity":
        body = measure.capacity_results(exp, runs_dir / exp.name, Measuring(path, only is None, retrain, jobs, quiet))
    else:  # one point at a time, whatever `jobs`: timings taken side by side would measure each other
        body = measure.efficiency_results(exp, runs_dir / exp.name, Measuring(path, only is None, retrain, 1, quiet))
    write_json(path, {**header, **body})
    if not quiet:
        print(f"wrote {path}", file=sys.stderr, flush=True)
    return path


def write_json(path: Path, data: dict[str, Any]) -> None:
    with staged_writes(path) as (partial,):  # a reader never sees half a file; a failed write leaves the last one
        partial.write_text(json.dumps(data, indent=1))


def chosen_runs(name: str, runs: list[Run], only: list[str]) -> set[str]:
    """The ids of the runs `only` names: each entry is a row's label (all its runs), a run id, or a glob over run ids
    (e.g. '*-dim64-*-s1' for one panel's second seed). An entry that names nothing is an error."""
    rows = list(dict.fromkeys(run.model for run in runs))
    ids = [run.run_id for run in runs]
    matches = {entry: [i for i in ids if fnmatch.fnmatchcase(i, entry)] for entry in only if entry not in rows}
    unmatched = [entry for entry, matched in matches.items() if not matched]
    if unmatched:
        raise ValueError(f"experiment {name} has no rows or runs {unmatched}; its rows are {rows}, its run ids look "
                         f"like {ids[0]!r}")
    return {run.run_id for run in runs if run.model in only}.union(*matches.values())


def train_grid(exp: Experiment, path: Path, runs_dir: Path, jobs: int, header: dict[str, Any], quiet: bool,
               retrain: bool, only: list[str] | None = None) -> dict[str, Any]:
    """Train the runs of `exp` (of its rows `only`, where given) that neither the results JSON at `path` nor the runs
    directory holds finished, writing the JSON after each (the runs so far, the rest "pending"); return the JSON's
    body."""
    runs = expand(exp)
    chosen = {run.run_id for run in runs} if only is None else chosen_runs(exp.name, runs, only)
    records, machine = json_records(path)
    done = {run_id: summary for run_id, summary in recorded_runs(records, machine, exp, runs).items()
            if not (retrain and run_id in chosen)}
    todo = [run for run in runs if run.run_id in chosen and run.run_id not in done]
    if not quiet:
        print(f"{exp.name}: {len(runs)} training runs ({len(done)} read back from {path}; {len(todo)} to train), "
              f"{jobs} at a time, in {runs_dir / exp.name}", flush=True)

    earlier = earlier_runs(records, machine, exp, runs)

    def body() -> dict[str, Any]:
        pending = [run.run_id for run in runs if run.run_id not in done]
        stale = {run_id: earlier[run_id] for run_id in pending if run_id in earlier}
        shown = [run for run in runs if run.run_id in done or run.run_id in stale]
        data = train_results(exp, shown, [done[r.run_id] if r.run_id in done else stale[r.run_id][1] for r in shown])
        for run_id, (config, _, changes) in stale.items():  # as trained, not as the grid would now train it
            data["runs"][run_id]["config"] = config
        return {**data, **({"pending": pending} if pending else {}),
                **({"stale": {run_id: changes for run_id, (_, _, changes) in stale.items()}} if stale else {})}

    def finish(i: int, summary: dict[str, Any]) -> None:
        done[todo[i].run_id] = {**summary, "machine": header["machine"]}
        write_json(path, {**header, **body()})

    for cfg in {json.dumps(run.config.task.to_dict(), sort_keys=True): run.config for run in todo}.values():
        checked_tasks(cfg)  # a task that cannot be built (its data or extra missing) stops the grid before it writes
    calls = [(run.config, runs_dir / exp.name / run.run_id, retrain) for run in todo]
    run_parallel(_train_or_error, calls, [run.run_id for run in todo], jobs,
                 functools.partial(describe_run, metric=exp.metric), quiet, on_result=finish)
    return body()
