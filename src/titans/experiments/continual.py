"""The `continual` experiment: the memory learning at test time (beyond the paper).

A model trained on short windows of the Python standard library reads a long document of its validation split that
it has never seen, in which a passage appears twice (`tasks.lm.repeated_passage_documents`): the text as the corpus
has it, then the same passage again after a gap. A model that learns from what it reads predicts the second reading
better than the first; one whose context cannot reach back over the gap (sliding-window attention with a window
shorter than the gap) predicts it no better. The measure is the bits per byte of the passage at its first and its
second reading and the drop between them, per model and gap.

The models are the trained runs of another experiment (`continual.source`, `lm` by default), read from its run
directories; a run not there yet is trained there first, exactly as that experiment would train it (and then reused
by it).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..tasks.lm import bits_per_byte, repeated_passage_documents
from ..train.batches import derive_seed, streamed
from ..train.loop import load_trained
from .runs import (
    _identity,
    _train_or_error,
    add_setting,
    cached,
    collect,
    config_changes,
    describe_run,
    json_data,
    over_seeds,
    recorded_config,
    run_parallel,
    run_record,
)
from .spec import Experiment, Run, expand, load_experiment

CONTINUAL_STREAM = 4  # the documents' seeds: apart from training (1), evaluation (2) and dropout (3)
READINGS = ("first reading", "second reading")


@torch.no_grad()
def passage_nats(model: nn.Module, documents: Tensor, starts: list[int], passage: int,
                 piece: int | None = None) -> list[Tensor]:
    """Per start, the summed cross-entropy (nats, float64) of the passage's bytes start + 1 .. start + passage - 1
    in `documents` [batch, length], each predicted from everything before it (read whole, or `piece` bytes per call
    through the model's state). The passage's first byte is left out: at a second reading it follows a break in the
    text that nothing predicts."""
    logits = streamed(model, documents[:, :-1], piece)  # logits[:, t] predicts documents[:, t + 1]
    return [F.cross_entropy(logits[:, start:start + passage - 1].flatten(0, 1),
                            documents[:, start + 1:start + passage].flatten().to(logits.device),
                            reduction="sum").double().cpu() for start in starts]


def passage_bits(model: nn.Module, data: Tensor, grid: dict[str, Any], gap: int) -> dict[str, float]:
    """The bits per byte of the passage at its first and its second reading, over `grid["documents"]` documents of
    `data` whose passage is repeated `gap` bytes later (the same documents for every model: seeded by the gap)."""
    prefix, passage = grid["prefix"], grid["passage"]
    documents = repeated_passage_documents(data, grid["documents"], prefix, passage, gap,
                                           torch.Generator().manual_seed(derive_seed(CONTINUAL_STREAM, gap)))
    device = next(model.parameters()).device
    sums = torch.zeros(2, dtype=torch.float64)
    for batch in documents.split(grid["batch_size"]):
        sums += torch.stack(passage_nats(model, batch.to(device), [prefix, prefix + passage + gap], passage,
                                         grid["piece"]))
    first, second = (bits_per_byte(float(s) / (len(documents) * (passage - 1))) for s in sums)
    return {"first": first, "second": second}


def continual_point(run_dir: str, grid: dict[str, Any], config: dict[str, Any], step: int,
                    train_seconds: float) -> dict[str, Any]:
    """Both readings at every gap for the trained run in `run_dir` (`config`, `step` and `train_seconds` key the
    cached result to the training it measured: a run deleted and trained again takes other seconds)."""
    _, _, task, model = load_trained(Path(run_dir))
    if task.name != "lm_bytes":
        raise ValueError(f"continual reads documents of lm_bytes; run {run_dir} trained on {task.name}")
    data = task.held_out().data
    return {str(gap): passage_bits(model, data, grid, gap) for gap in grid["gaps"]}


def recorded_points(path: Path | None, grid: dict[str, Any],
                    runs: list[Run]) -> tuple[dict[int, dict[str, Any]], dict[int, tuple[dict[str, Any], list[str]]]]:
    """({index in `runs`: its record} for the runs whose measurement the continual JSON at `path` holds for the same
    grid and exactly the run's config, {index: (its record, what changed since)} for those it holds measured under
    another config or grid). The first are read back (as the training grids read a run back from their JSON: a fresh
    clone, which has the JSON but not the source's trained runs, then trains and measures only the models whose config
    changed); the second are measured again, or under --no-train shown as recorded and marked stale."""
    data = json_data(path)
    kept, earlier = {}, {}
    for i, run in enumerate(runs):
        record = data.get("runs", {}).get(run.run_id)
        saved = recorded_config(record)
        values = record.get("values") if saved is not None else None
        if not values or None in values.values():  # not recorded, or a measurement missing: measured again
            continue
        changes = config_changes({"grid": data.get("grid"), **_identity(saved)},
                                 {"grid": grid, **_identity(run.config)})
        if changes:
            earlier[i] = (record, changes)
        else:
            kept[i] = record
    return kept, earlier


def continual_results(exp: Experiment, runs_dir: Path, jobs: int, quick: bool, quiet: bool = False,
                      recorded: Path | None = None, measure: bool = True) -> dict[str, Any]:
    """The continual JSON body: panels "first reading", "second reading" (bits per byte, lower is better) and "drop"
    (first − second, higher is better) against the gap, one row per model of the source experiment (those of
    `exp.variants`). A model whose measurement the JSON at `recorded` holds (same grid, same config) is read back
    from it; the other source runs are trained where missing, and each measurement is kept beside them in
    `runs_dir/<experiment>` and reused while the run and the grid stay the same."""
    grid = exp.continual
    source = load_experiment(grid.source, quick=quick)
    # rows by name: a source's extra model of a listed variant (lm's "mac paper order") is a row of its own, not one
    # of these, and is neither trained nor measured here
    runs = [run for run in expand(source) if run.model in exp.variants]
    if not runs:
        raise ValueError(f"experiment {exp.name}: {grid.source} has no runs of the variants {exp.variants}")
    kept, earlier = recorded_points(recorded, grid.to_dict(), runs)
    todo = [i for i in range(len(runs)) if i not in kept] if measure else []
    dirs = [runs_dir / source.name / run.run_id for run in runs]
    if not quiet:
        print(f"{exp.name}: the {len(runs)} runs of {source.name} ({len(kept)} read back from {recorded}; "
              + (f"the rest trained where missing), {jobs} at a time" if measure else "nothing measured)"), flush=True)
    trained = run_parallel(_train_or_error, [(runs[i].config, dirs[i]) for i in todo], [runs[i].run_id for i in todo],
                           jobs, functools.partial(describe_run, metric=source.metric), quiet)
    summaries: dict[int, dict[str, Any]] = dict(zip(todo, trained))
    measured = [i for i, summary in summaries.items() if "error" not in summary]
    calls = [(runs_dir / exp.name / f"{runs[i].run_id}.json", continual_point, str(dirs[i]), grid.to_dict(),
              runs[i].config.to_dict(), summaries[i]["step"], summaries[i]["train_seconds"]) for i in measured]
    points = dict(zip(measured, run_parallel(
        cached, calls, [runs[i].run_id for i in measured], jobs,
        lambda p: ", ".join(f"gap {g}: {v['first']:.3f} -> {v['second']:.3f}" for g, v in p.items()), quiet)))
    panels: dict[str, dict[str, Any]] = {}
    for gap in grid.gaps:
        for panel, better in ((READINGS[0], False), (READINGS[1], False), ("drop", True)):
            add_setting(panels, panel, f"{panel}/{gap}", float(gap), higher_is_better=better)
    per_seed: dict[str, dict[str, list[float | None]]] = {}
    records = {}
    # not measured here (under --no-train): shown as recorded under an earlier config and marked stale, or pending
    shown = {**kept, **{i: record for i, (record, _) in earlier.items() if i not in summaries}}
    stale = {runs[i].run_id: changes for i, (_, changes) in earlier.items() if i not in summaries}
    pending = [run.run_id for i, run in enumerate(runs) if i not in kept and i not in summaries]
    for i, run in enumerate(runs):
        if i in shown:
            collect(per_seed, run.model, shown[i]["values"])
            records[run.run_id] = shown[i]
            continue
        if i not in summaries:
            continue
        point = points.get(i)
        values: dict[str, float | None] = {}
        for gap in grid.gaps:
            first, second = (point[str(gap)]["first"], point[str(gap)]["second"]) if point else (None, None)
            values[f"{READINGS[0]}/{gap}"], values[f"{READINGS[1]}/{gap}"] = first, second
            values[f"drop/{gap}"] = None if point is None else first - second
        collect(per_seed, run.model, values)
        records[run.run_id] = {**run_record(run, summaries[i], values), "source": f"{source.name}/{run.run_id}"}
    return {"panels": panels, **over_seeds(per_seed), "runs": records, "grid": grid.to_dict(),
            **({"pending": pending} if pending else {}), **({"stale": stale} if stale else {})}
