"""`titans experiment report`: docs/RESULTS.md, the plots and the README's results block, from the results JSON alone.

Every number written here is read from a `docs/results/<experiment>.json` that `titans experiment run` wrote; the
prose around the tables (what an experiment measures, what we think explains it) is in the JSON too, copied there
from the experiment's YAML. The README keeps its own text outside the block between `README_START` and `README_END`,
which the report replaces with one headline table (`HEADLINE`: a few claims, each at the largest x of one panel,
current rows only); every grid is in RESULTS.md.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path
from typing import Any

from ..models.config import TITANS_VARIANTS
from .spec import MISSING, model_field

# the issues' order; others follow by name
ORDER = ("niah", "babilong", "mqar", "long", "capacity", "efficiency", "lm", "ablations_lm", "ablations_niah",
         "continual")
TRAINED = ("train", "continual")  # kinds whose rows are trained models (Titans variants against baselines)
README_START = "<!-- experiments:start (written by `titans experiment report`; edit the YAML, not this) -->"
README_END = "<!-- experiments:end -->"
# RESULTS.md from this line on is hand-written (the notes behind DESIGN.md's choices): the report keeps it as it is.
NOTES_START = "<!-- notes: hand-written from here on; `titans experiment report` keeps them as they are -->"
REQUIRED = ("experiment", "metric", "higher_is_better", "results", "runs", "panels")


def load_results(results_dir: Path) -> list[dict[str, Any]]:
    """Every results JSON in `results_dir`, in report order; a file that is not one is an error naming it."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except ValueError as err:
            raise ValueError(f"{path} is not valid JSON: {err}") from None
        missing = [key for key in REQUIRED if not isinstance(data, dict) or key not in data]
        if missing:
            raise ValueError(f"{path} is not an experiment's results (missing {', '.join(missing)})")
        found.append(data)
    if not found:
        raise ValueError(f"no results JSON in {results_dir}; run `titans experiment run NAME` first")
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda d: (rank.get(d["experiment"], len(ORDER)), d["experiment"]))


def relative(path: Path, start: Path) -> str:
    """`path` as a link from a file in `start` (Markdown links are relative to the file that holds them)."""
    return Path(os.path.relpath(path.resolve(), start.resolve())).as_posix()


def fmt(value: float | None, metric: str) -> str:
    """Accuracies to two decimals; bits per byte to three (ablations differ by a hundredth of a bit: 2.485 beside
    2.495, not 2.48 beside 2.5); anything else (losses, counts, tokens/s) to three significant digits, so that a mean
    squared error of 0.0343 is not printed as 0.03 beside a 0.0293, and whole numbers from 100 on."""
    if value is None:
        return "failed"
    if "accuracy" in metric:
        return f"{value:.2f}"
    if "bits" in metric:
        return f"{value:.3f}"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.3g}"


def x_text(x: float) -> str:
    return f"{x:g}"


def panel_better(data: dict[str, Any], panel: dict[str, Any]) -> bool:
    return panel.get("higher_is_better", data["higher_is_better"])


def x_label_of(data: dict[str, Any], panel: dict[str, Any]) -> str:
    """The panel's own x axis (positions in the context) or the experiment's."""
    return panel.get("x_label") or data.get("x_label", "x")


def panel_table(data: dict[str, Any], panel: dict[str, Any], labels: list[str],
                higher_is_better: list[bool] | None = None) -> str:
    """Markdown: one row per model, one column per setting of `panel` (headed by `labels`); the best value of a
    column in bold (by `higher_is_better` per column, default the panel's), the seeds' range beside the mean where
    there are several."""
    spread = data.get("spread", {})
    directions = higher_is_better or [panel_better(data, panel)] * len(panel["settings"])
    best = {}
    for setting, better in zip(panel["settings"], directions):
        values = [r.get(setting) for r in data["results"].values() if r.get(setting) is not None]
        if len(set(values)) > 1:  # a column where every model ties has no best
            best[setting] = max(values) if better else min(values)
    lines = ["| model | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    stale = stale_rows(data)
    for model, by_setting in data["results"].items():
        cells = []
        for setting in panel["settings"]:
            value = by_setting.get(setting)
            text = fmt(value, data["metric"]) if setting in by_setting else "-"
            low_high = spread.get(model, {}).get(setting)
            if low_high and low_high[0] != low_high[1]:
                text += f" ({fmt(low_high[0], data['metric'])}–{fmt(low_high[1], data['metric'])})"
            if value is not None and value == best.get(setting):
                text = f"**{text}**"
            cells.append(text)
        mark = " (stale)" if model in stale else ""
        lines.append(f"| {model}{mark} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def stale_rows(data: dict[str, Any]) -> set[str]:
    """The rows with a run shown from an earlier config (`stale`): their cells are not yet the grid's."""
    stale = data.get("stale", {})
    return {record["model"] for run_id, record in data["runs"].items() if run_id in stale and "model" in record}


def last_setting(data: dict[str, Any]) -> str:
    """The last column of the first panel: where a single-setting view (heat map, published figures) reads."""
    return next(iter(data["panels"].values()))["settings"][-1]


def heatmap_cells(data: dict[str, Any]) -> tuple[list[float], list[float], dict[tuple[float, float], float]]:
    """(x values, y values, {(x, y): result}) of the rows that set both heat-map fields, at the last setting of the
    first panel; rows without them (a baseline) stay in the table only."""
    axes = data["heatmap"]
    setting = last_setting(data)
    cells = {}
    for run in data["runs"].values():
        model = run.get("config", {}).get("model", {})
        value = data["results"].get(run["model"], {}).get(setting)
        x, y = (model_field(model, axes[axis]) for axis in ("x", "y"))  # records flat (older) or nested
        if x not in (None, MISSING) and y not in (None, MISSING) and value is not None:
            cells[(x, y)] = value
    return sorted({x for x, _ in cells}), sorted({y for _, y in cells}), cells


def plot_heatmap(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs, ys, cells = heatmap_cells(data)
    grid = [[cells.get((x, y), float("nan")) for x in xs] for y in ys]
    fig, ax = plt.subplots(figsize=(1.2 * len(xs) + 2.4, 1.0 * len(ys) + 1.6))
    image = ax.imshow(grid, origin="lower", cmap="viridis" if data["higher_is_better"] else "viridis_r")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            red, green, blue, _ = image.cmap(image.norm(value)) if value == value else (0, 0, 0, 1)
            light = 0.299 * red + 0.587 * green + 0.114 * blue > 0.5  # dark text on the yellow end of viridis
            ax.text(j, i, fmt(value, data["metric"]) if value == value else "-", ha="center", va="center",
                    fontsize=8, color="black" if light else "white")
    ax.set_xticks(range(len(xs)), [x_text(x) for x in xs])
    ax.set_yticks(range(len(ys)), [x_text(y) for y in ys])
    ax.set_xlabel(data["heatmap"]["x"], fontsize=8)
    ax.set_ylabel(data["heatmap"]["y"], fontsize=8)
    fig.colorbar(image, ax=ax, label=data["metric"])
    ax.set_title(data.get("title", data["experiment"]), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(data: dict[str, Any], path: Path) -> None:
    """One panel per plot panel, a line per model against x (log2 axis when x spans a factor of 8 or more, but
    positions in a context read linearly), or where a panel has a single column a point per model with the seeds'
    range; a heat map over two model settings where the experiment asks for one."""
    if not data["panels"]:  # nothing trained yet: no plot (and none left from an earlier grid)
        path.unlink(missing_ok=True)
        return None
    if data.get("heatmap"):
        return plot_heatmap(data, path)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = data["panels"]
    many = len(data["results"]) > MANY_ROWS
    height = 0.17 * len(data["results"]) + 1.6 if many else 3.6
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), height), squeeze=False)
    for ax, (name, panel) in zip(axes[0], panels.items()):
        xs = panel["x"]
        if many:
            plot_rows(ax, data, panel, name)
            continue
        if len(xs) == 1:
            plot_models(ax, data, panel, name)
            continue
        for model, by_setting in data["results"].items():
            points = [(x, by_setting.get(s)) for x, s in zip(xs, panel["settings"]) if by_setting.get(s) is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=model)
        if min(xs) > 0 and max(xs) / min(xs) >= 8 and "positions_of" not in panel:
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs, [x_text(x) for x in xs], fontsize=7)
        ax.set_xlabel(x_label_of(data, panel), fontsize=8)
        ax.set_ylabel(name if "higher_is_better" in panel else data["metric"], fontsize=8)  # a panel with own metric
        if "accuracy" in data["metric"]:
            ax.set_ylim(-0.02, 1.02)
        elif data["metric"] != "capacity" and all(v > 0 for r in data["results"].values() for s in panel["settings"]
                                                  if (v := r.get(s)) is not None):  # a drop may be negative
            ax.set_yscale("log")
        if name:  # an unnamed single panel: the figure's title names it
            ax.set_title(name, fontsize=9)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][-1].get_legend_handles_labels()
    if handles and many:  # below the panels, where no row's markers are
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7)
    elif handles:
        axes[0][-1].legend(fontsize=7, loc="best")
    # wrapped to the figure's width (about 11 characters an inch at this size): one narrow panel cut long titles off
    fig.suptitle(textwrap.fill(data.get("title", data["experiment"]), width=int(11 * 4.2 * len(panels))), fontsize=10)
    fig.tight_layout(rect=(0, 0.35 / height if many else 0, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# Beyond this many rows a line per model cannot be told apart (nor its legend fit): a row per model instead.
MANY_ROWS = 16


def plot_rows(ax: Any, data: dict[str, Any], panel: dict[str, Any], name: str) -> None:
    """A panel of many models (an ablation grid): a row per model, labelled, with a marker per column of the panel
    joined by a faint line, so that each row's value and its change with x read off one line."""
    models = [m for m, r in data["results"].items() if any(r.get(s) is not None for s in panel["settings"])]
    for i, model in enumerate(models):
        values = [v for s in panel["settings"] if (v := data["results"][model].get(s)) is not None]
        ax.plot(values, [i] * len(values), color="0.75", linewidth=0.8, zorder=1)
    for j, (x, setting) in enumerate(zip(panel["x"], panel["settings"])):
        rows = [(v, i) for i, m in enumerate(models) if (v := data["results"][m].get(setting)) is not None]
        if rows:
            ax.plot(*zip(*rows), marker="os^vD"[j % 5], markersize=4, linestyle="none", zorder=2,
                    label=f"{x_label_of(data, panel)} {x_text(x)}")
    ax.set_yticks(range(len(models)), models, fontsize=7)
    ax.set_ylim(len(models) - 0.5, -0.5)  # the first row on top, as in the table
    ax.set_xlabel(name if "higher_is_better" in panel else data["metric"], fontsize=8)
    if name:
        ax.set_title(name, fontsize=9)
    ax.grid(alpha=0.3, axis="x")


def plot_models(ax: Any, data: dict[str, Any], panel: dict[str, Any], name: str) -> None:
    """A panel of one column: the models side by side, each its mean with a bar over the seeds' range."""
    setting = panel["settings"][0]
    spread = data.get("spread", {})
    models = [m for m, r in data["results"].items() if r.get(setting) is not None]
    for i, model in enumerate(models):
        mean = data["results"][model][setting]
        low, high = spread.get(model, {}).get(setting) or (mean, mean)
        # max(0, ·): the mean of equal values can land an ulp outside their range (five equal seeds of a baseline)
        ax.errorbar([i], [mean], yerr=[[max(mean - low, 0.0)], [max(high - mean, 0.0)]], marker="o", markersize=4,
                    capsize=3)
    ax.set_xticks(range(len(models)), models, fontsize=7, rotation=30)
    ax.set_xlim(-0.6, len(models) - 0.4)
    ax.set_ylabel(data["metric"], fontsize=8)
    where = f"{x_label_of(data, panel)} {x_text(panel['x'][0])}"
    ax.set_title(f"{name} ({where})" if name else where, fontsize=9)  # the figure's title names the experiment
    ax.grid(alpha=0.3, axis="y")


def best_line(data: dict[str, Any], panel: dict[str, Any], name: str, end: int, memory: set[str]) -> str | None:
    """Who is best at the panel's x number `end`; None where no model has a value there."""
    setting, x = panel["settings"][end], panel["x"][end]
    values = {m: r.get(setting) for m, r in data["results"].items() if r.get(setting) is not None}
    if not values:
        return None
    pick = max if panel_better(data, panel) else min
    top = pick(values.values())
    where = f"{name}, {x_label_of(data, panel)} {x_text(x)}" if name else f"{x_label_of(data, panel)} {x_text(x)}"
    if len(set(values.values())) == 1:
        return f"{where}: every model at {fmt(top, data['metric'])}."
    leaders = [m for m, v in values.items() if v == top]
    line = f"{where}: best {', '.join(leaders)} ({fmt(top, data['metric'])}" + (", tied)" if len(leaders) > 1 else ")")
    ours = {m: v for m, v in values.items() if m in memory}
    theirs = {m: v for m, v in values.items() if m not in memory}
    if ours and theirs and data.get("kind", "train") in TRAINED:
        a, b = pick(ours, key=ours.get), pick(theirs, key=theirs.get)
        line += f"; best Titans variant {a} {fmt(ours[a], data['metric'])} against best baseline {b} " \
                f"{fmt(theirs[b], data['metric'])}"
    return line + "."


def observations(data: dict[str, Any]) -> list[str]:
    """Sentences computed from the numbers: per panel, who is best at the smallest and the largest x (train
    experiments over lengths: the training length and the farthest evaluation), and for train experiments how the
    best Titans variant compares with the best baseline there; per panel against position, each model's first span
    against its last."""
    variant_of = {run["model"]: run["config"].get("model", {}).get("variant", run["model"])
                  for run in data["runs"].values() if isinstance(run.get("config"), dict)}
    memory = {m for m in data["results"] if variant_of.get(m, m) in TITANS_VARIANTS}
    lines = []
    for name, panel in data["panels"].items():
        if "positions_of" in panel:
            lines.append(position_line(data, panel, name))
            continue
        ends = [0, -1] if data.get("kind", "train") in TRAINED and len(panel["x"]) > 1 else [-1]
        for end in ends:
            line = best_line(data, panel, name, end, memory)
            if line:
                lines.append(line)
    for model, against in data.get("compare", []):
        for name, panel in data["panels"].items():
            mine, theirs = data["results"].get(model, {}), data["results"].get(against, {})
            ratios = [f"{x_text(x)}: {mine[s] / theirs[s]:.2f}×" for x, s in zip(panel["x"], panel["settings"])
                      if mine.get(s) is not None and theirs.get(s)]
            if ratios:
                lines.append(f"{name or data['metric']}, {model} / {against} ({x_label_of(data, panel)}): "
                             + ", ".join(ratios) + ".")
    return lines


def position_line(data: dict[str, Any], panel: dict[str, Any], name: str) -> str:
    """Per model, the metric over the first span of positions against the last: do later tokens cost less?"""
    first, last = panel["settings"][0], panel["settings"][-1]
    pairs = [f"{model} {fmt(r.get(first), data['metric'])} → {fmt(r.get(last), data['metric'])}"
             for model, r in data["results"].items() if r.get(first) is not None and r.get(last) is not None]
    return f"{name}, the first span of positions (to {x_text(panel['x'][0])}) → the last (to " \
           f"{x_text(panel['x'][-1])}): " + ", ".join(pairs) + "."


def largest(runs: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
    """The run with the largest `key` among a model's runs that recorded one; None where none did."""
    kept = [r for r in runs if r.get(key) is not None]
    return max(kept, key=lambda r: r[key]) if kept else None


def peak_grad(runs: list[dict[str, Any]]) -> str:
    """The largest gradient norm before clipping over a model's runs, with the seed and step it came at: a spike
    that clipping absorbed is still seen. "—" where no run recorded it (runs trained before it was kept)."""
    top = largest(runs, "peak_grad_norm")
    return "—" if top is None else f"{top['peak_grad_norm']:.3g} (s{top['seed']}: {top['peak_grad_step']})"


def bound_lowered(runs: list[dict[str, Any]]) -> str:
    """The largest share of learned θ_t that the momentum-gain bound lowered in training over a model's runs, with
    its seed: where the bound acted, the run differs from one under the paper's free gates. "—" where no run
    bounded θ (no memory, κ off, constant gates) or recorded it (runs trained before it was kept)."""
    top = largest(runs, "momentum_bound_share")
    return "—" if top is None else f"{top['momentum_bound_share']:.2%} (s{top['seed']})"


def run_facts(data: dict[str, Any]) -> str:
    """Parameters, steps and training time per model, from the runs (train experiments), and the runs that the time
    budget stopped before their steps (those had a smaller budget than the rest: the reader must see which)."""
    by_model: dict[str, list[dict[str, Any]]] = {}
    short = []
    for run_id, run in data["runs"].items():
        if "num_parameters" in run and "steps" in run:
            by_model.setdefault(run["model"], []).append(run)
            if run["steps"] < run["config"]["steps"]:
                short.append(f"{run_id} ({run['steps']} of {run['config']['steps']})")
    if not by_model:
        return ""
    lines = ["| model | parameters | steps (mean) | training seconds (mean) | skipped steps | largest gradient norm "
             "(seed: step) | θ_t lowered by κ, largest (seed) | failed runs |", "|---" + "|---:" * 7 + "|"]
    failed = {m: sum("error" in r for r in data["runs"].values() if r["model"] == m) for m in by_model}
    for model, runs in by_model.items():
        params = sorted({r["num_parameters"] for r in runs})
        shown = f"{params[0]:,}" if len(params) == 1 else f"{params[0]:,}–{params[-1]:,}"
        lines.append(f"| {model} | {shown} | {sum(r['steps'] for r in runs) / len(runs):.0f} | "
                     f"{sum(r['seconds'] for r in runs) / len(runs):.0f} | "
                     f"{sum(r.get('skipped_steps', 0) for r in runs)} | {peak_grad(runs)} | {bound_lowered(runs)} | "
                     f"{failed[model]} |")
    if short:
        lines += ["", f"Stopped by the time budget before their steps: {', '.join(short)}."]
    return "\n".join(lines)


def published_table(data: dict[str, Any]) -> str:
    """Ours beside figures published elsewhere for the same experiment (quoted from the YAML, with their source)."""
    published = data["published"]
    setting = published.get("setting") or last_setting(data)
    lines = [f"Beside published figures ({published['source']}), at {data.get('x_label', 'x')} {setting}:", "",
             "| model | ours | published |", "|---|---:|---:|"]
    for model, theirs in published["values"].items():
        ours = fmt(data["results"][model].get(setting), data["metric"]) if model in data["results"] else "not run"
        lines.append(f"| {model} | {ours} | {theirs:g} |")
    return "\n".join(lines)


def section(data: dict[str, Any], json_path: Path, plot_path: Path, relative_to: Path) -> str:
    seeds = sorted({r["seed"] for r in data["runs"].values() if "seed" in r})
    parts = [f"## {data.get('title', data['experiment'])}", "",
             f"`{data.get('command', 'titans experiment run ' + data['experiment'])}` → "
             f"[`{json_path.as_posix()}`]({relative(json_path, relative_to)})"
             + (f" ({data['tier']} tier)" if data.get("tier") == "quick" else "") + f"; {data.get('machine', '')}"
             + (f"; seeds {', '.join(map(str, seeds))} (mean, range in brackets)" if len(seeds) > 1 else ""), ""]
    if data.get("pending"):
        stale = data.get("stale", {})
        waiting = "the empty cells are runs still to come" if len(stale) < len(data["pending"]) else ""
        shown = (f"{len(stale)} more are shown as trained under an earlier config, until they are trained again "
                 f"(what the grid has changed since: {'; '.join(stale_changes(data))})") if stale else ""
        parts += [f"**Incomplete**: {partial_text(data)}; " + "; ".join(filter(None, (waiting, shown)))
                  + f"; `{data.get('command', '')}` continues the grid.", ""]
    machines = machines_of(data)
    if len(machines) > 1:
        parts += ["The runs were trained on several machines (their seconds are not comparable across them): "
                  + "; ".join(f"{m} ({n} runs)" for m, n in machines.items()) + ".", ""]
    if data.get("about"):
        parts += [data["about"], ""]
    better = "higher is better" if data["higher_is_better"] else "lower is better"
    parts += [f"Metric: {data['metric']} ({better}; the best of each column in bold).", ""]
    if data.get("baselines"):
        rows = ", ".join(f"{label} (`{metric}`)" for label, metric in data["baselines"].items())
        parts += [f"Rows that are no trained model: {rows}, scored by every run's evaluation on the sequences its "
                  "model was scored on.", ""]
    for name, panel in data["panels"].items():
        heading = [f"{name}:", ""] if name else []
        labels = [f"{x_label_of(data, panel)} {x_text(x)}" if i == 0 else x_text(x) for i, x in enumerate(panel["x"])]
        parts += heading + [panel_table(data, panel, labels), ""] + second_table(data, panel, labels)
    if data.get("published"):
        parts += [published_table(data), ""]
    if plot_path.is_file():
        parts += [f"![{data['experiment']}]({relative(plot_path, relative_to)})", ""]
    facts = run_facts(data)
    if facts:
        parts += [facts, ""]
    parts += ["What the numbers say (computed from the JSON):", ""] + [f"- {line}" for line in observations(data)]
    parts.append("")
    if data.get("discussion"):
        parts += ["What we think explains them: " + data["discussion"], ""]
    return "\n".join(parts)


# what a second metric (the experiment's `second_metric`, the JSON's "second") is, in the sentence above its table
SECOND_TEXT = {"token_accuracy": "the share of the answer's tokens predicted right, which shows a model that learned "
                                  "part of the answer where exact match scores it 0",
               "accuracy": "exact match, the share of answers with every token right (the whole key)"}


def second_table(data: dict[str, Any], panel: dict[str, Any], labels: list[str]) -> list[str]:
    """The lines of the second metric's table for a panel of the headline's (none for a panel against position, or
    where the JSON has no second metric): the same runs, rows and columns, under the headline table."""
    second = data.get("second")
    if not second or "positions_of" in panel:
        return []
    shown = {**data, "metric": second["metric"], "results": second["results"], "spread": second["spread"]}
    text = SECOND_TEXT.get(second["metric"], second["metric"])
    return [f"Beside it, {second['metric']}: {text} (the same runs; the table above stays the headline).", "",
            panel_table(shown, panel, labels), ""]


def partial_text(data: dict[str, Any]) -> str:
    """'N of M runs finished' under the grid's config (a stale run, shown from an earlier config, is not)."""
    finished = len(data["runs"]) - len(data.get("stale", {}))
    return f"{finished} of {finished + len(data['pending'])} runs finished"


def stale_changes(data: dict[str, Any]) -> list[str]:
    """The config changes behind the stale runs, each once, with how many runs it concerns."""
    count: dict[str, int] = {}
    for changes in data.get("stale", {}).values():
        for change in changes:
            count[change] = count.get(change, 0) + 1
    return [f"{change} ({n} runs)" for change, n in count.items()]


def machines_of(data: dict[str, Any]) -> dict[str, int]:
    """{machine: number of runs trained on it}, for the runs that name theirs."""
    count: dict[str, int] = {}
    for run in data["runs"].values():
        if run.get("machine"):
            count[run["machine"]] = count.get(run["machine"], 0) + 1
    return count


# The README's one results table: a row per claim (what Titans does here), each read from one panel of one
# experiment at its largest x, Titans rows beside baselines. A row trained under an earlier config (stale) or not
# in the JSON is left out, and a claim with no Titans row left is left out whole: the README shows current numbers.
HEADLINE = (  # (experiment, panel, Titans rows, baseline rows)
    ("long", "", ("lmm", "mac"), ("swa",)),
    ("niah", "passkey", ("lmm", "mac", "mag", "mal"), ("transformer", "gated_deltanet", "swa", "lstm")),
    ("lm", "", ("mac", "mag", "mal", "lmm"), ("transformer", "gated_deltanet", "swa", "lstm")),
    ("efficiency", "training tokens/s", ("mac dim256",), ("titans-pytorch mac",)),
    ("efficiency", "peak memory (MiB)", ("mac dim256",), ("titans-pytorch mac",)),
)


def headline_row(data: dict[str, Any], panel_name: str, titans: tuple[str, ...], baselines: tuple[str, ...],
                 results_md: str) -> str | None:
    """One row of the README's table: the panel's largest x (and, for a trained experiment over lengths, the
    training length it is read against), `model value` for each current row; None where no Titans row is current."""
    panel = data["panels"].get(panel_name)
    if panel is None:
        return None
    setting, stale = panel["settings"][-1], stale_rows(data)
    metric = panel_name or data["metric"]

    def cells(models: tuple[str, ...]) -> str:
        return ", ".join(f"{m} {fmt(data['results'][m][setting], data['metric'])}" for m in models
                         if m in data["results"] and m not in stale and data["results"][m].get(setting) is not None)

    ours, theirs = cells(titans), cells(baselines)
    if not ours:
        return None
    title = data.get("title", data["experiment"])
    anchor = "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c in "-_")
    where = f"{data.get('x_label', 'x')} {x_text(panel['x'][-1])}"
    if data.get("kind", "train") in TRAINED and data.get("x_axis", "length") == "length" and len(panel["x"]) > 1:
        where += f", trained at {x_text(panel['x'][0])}"
    better = "higher is better" if panel_better(data, panel) else "lower is better"
    if data.get("pending"):  # the rows shown are current; the grid is not finished
        better += f"; incomplete, {partial_text(data)}"
    return (f"| [{title}]({results_md}#{anchor}): {metric} at {where} ({better}) | {ours} | {theirs or '-'} | "
            f"`{data.get('command', 'titans experiment run ' + data['experiment'])}` |")


def headline(experiments: list[dict[str, Any]], results_md: str) -> str:
    """The README's results block: one table over the claims of `HEADLINE` whose experiment has results."""
    by_name = {d["experiment"]: d for d in experiments}
    rows = [headline_row(by_name[name], panel, titans, baselines, results_md)
            for name, panel, titans, baselines in HEADLINE if name in by_name]
    rows = [r for r in rows if r is not None]
    return "\n".join(["| result | Titans | baselines | command (writes the JSON) |", "|---|---|---|---|", *rows,
                       "", f"Every grid, plot and run: [{Path(results_md).name}]({results_md}).", ""])


def write_report(results_dir: Path, out: Path, readme: Path | None = None) -> Path:
    """RESULTS.md (and a PNG per experiment beside the JSON) from every results JSON in `results_dir`; with
    `readme`, its experiments block replaced by the one headline table. Returns the RESULTS.md path."""
    experiments = load_results(results_dir)
    if readme is not None:
        text = readme.read_text()
        if text.count(README_START) != 1 or text.count(README_END) != 1 or \
                text.index(README_START) > text.index(README_END):
            raise ValueError(f"{readme} must hold one {README_START!r} line before one {README_END!r} line")
    sections = []
    for data in experiments:
        plot_path = results_dir / f"{data['experiment']}.png"
        plot(data, plot_path)
        sections.append(section(data, results_dir / f"{data['experiment']}.json", plot_path, out.parent))
    intro = ["# Results", "",
             "Generated by `titans experiment report` from the JSON files in "
             f"`{results_dir.as_posix()}`; every number below is read from them. Each experiment's grid is "
             "`configs/experiments/<name>.yaml`; its command reruns it (finished runs are reused).", "", ""]
    old = out.read_text() if out.is_file() else ""
    notes = "\n" + old[old.index(NOTES_START):] if NOTES_START in old else ""
    out.write_text("\n".join(intro) + "\n".join(sections) + notes)
    if readme is not None:
        text = readme.read_text()
        before, rest = text.split(README_START)
        _, after = rest.split(README_END)
        block = headline(experiments, relative(out, readme.parent))
        readme.write_text(before + README_START + "\n\n" + block + README_END + after)
    return out

