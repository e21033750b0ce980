"""The experiment runner: every shipped experiment's quick tier end to end (grid → runs → JSON → report), resuming,
failures, the capacity reader and the command line."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from titans.cli import app
from titans.experiments import expand, experiment_names, load_experiment, run_experiment, write_report
from titans.experiments.measure import memory_reader
from titans.experiments.report import README_END, README_START, fmt, load_results, plot_models, stale_rows
from titans.experiments.runner import grid_words, train_results
from titans.experiments.runs import _train_or_error, describe_run, finished, resumable, train_one
from titans.models.config import FLAT_FIELDS, PEER_VARIANTS, flat_field_path
from titans.tasks import measure_capacity
from titans.train import build_model, build_task, train

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "configs" / "experiments"
ISSUE_EXPERIMENTS = {"niah", "babilong", "mqar", "long", "capacity", "efficiency", "encoder", "lm", "ablations_lm",
                     "ablations_niah", "continual", "mac_switches", "mac_budget"}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    """Every shipped experiment's quick tier, run once for the module: (results dir, runs dir)."""
    root = tmp_path_factory.mktemp("experiments")
    for name in experiment_names(FOLDER):
        run_experiment(load_experiment(name, quick=True, folder=FOLDER), root / "results", root / "runs", jobs=1,
                       quick=True, quiet=True)
    return root / "results", root / "runs"


def test_the_issue_experiments_are_shipped_and_load_in_both_tiers():
    assert ISSUE_EXPERIMENTS <= set(experiment_names(FOLDER))
    for name in experiment_names(FOLDER):
        full, quick = load_experiment(name, folder=FOLDER), load_experiment(name, quick=True, folder=FOLDER)
        assert full.name == quick.name == name and full.title and full.about
        if full.kind == "train":
            assert len(expand(quick)) < len(expand(full))
            for run in expand(full):  # every run keeps to the experiment's time budget, on one thread
                assert run.config.time_budget_s == full.time_budget_s and run.config.threads == 1


@pytest.mark.parametrize("name", ["niah", "babilong", "mqar", "long", "sine", "wind", "lm"])
def test_full_grids_are_parameter_matched(name):
    """Within a size, every variant of a train experiment has the same parameters to within 2% (another
    implementation's row, titans-pytorch's, is built as its authors recommend: its count is shown, not matched)."""
    exp = load_experiment(name, folder=FOLDER)
    by_size: dict[tuple, list[int]] = {}
    for run in expand(exp):
        if run.seed != exp.seeds[0] or run.config.model.variant in PEER_VARIANTS:
            continue
        cfg = run.config
        count = sum(p.numel() for p in build_model(cfg, build_task(cfg)).parameters())
        by_size.setdefault((run.panel, cfg.model.dim), []).append(count)
    for counts in by_size.values():
        assert max(counts) / min(counts) < 1.02, counts


def test_ablation_rows_keep_their_models_parameters():
    """Each removal keeps its variant's parameter count (to 2%); the memory depths 1-4 share one count (that of the
    four-layer memory at the defaults); the S-NIAH ablations take the very rows of the LM ones."""
    exp = load_experiment("ablations_lm", folder=FOLDER)
    counts = {run.model: sum(p.numel() for p in build_model(run.config, build_task(run.config)).parameters())
              for run in expand(exp)}
    for variant in ("lmm", "mac"):
        depths = [counts[f"{variant} depth{d}"] for d in (1, 2, 3, 4)]
        assert max(depths) / min(depths) < 1.02, depths
        rest = [n for label, n in counts.items() if label.startswith(variant) and "depth" not in label]
        assert len(rest) >= 9 and max(rest) / counts[variant] < 1.02 and min(rest) / counts[variant] > 0.98, rest
    assert depths[-1] == counts["mac depth4"] > 1.5 * counts["mac"]  # the deep memory's hidden layers are big
    niah = load_experiment("ablations_niah", folder=FOLDER)
    assert niah.models == exp.models and niah.metric == "token_accuracy" and exp.metric == "bits_per_byte"
    assert niah.eval_multiples == exp.eval_multiples == [1, 4]


def test_encoder_grid_is_parameter_matched_and_trains_each_set_at_its_length():
    """The encoder experiment's classifiers (one feature, two classes on both UCR sets: tests/tasks/test_ucr.py
    checks that where aeon is installed) have the same parameters to within 2%; each set has its own length."""
    from titans.models import ClassificationHead, TitansEncoder

    exp = load_experiment("encoder", folder=FOLDER)
    runs = expand(exp)
    counts = {run.model: sum(p.numel() for p in ClassificationHead(TitansEncoder(1, config=run.config.model), 2)
                             .parameters()) for run in runs}
    assert set(counts) == {"lmm", "mac", "mag", "mal", "transformer", "lstm"}
    assert max(counts.values()) / min(counts.values()) < 1.02, counts
    lengths = {run.panel: (run.config.task.train_length, run.config.task.eval_lengths) for run in runs}
    assert lengths == {"ItalyPowerDemand": (24, [24]), "GunPoint": (150, [150])}
    assert {run.setting(150, exp) for run in runs if run.task == "GunPoint"} == {"GunPoint/150"}


def test_quick_results_hold_what_the_issue_names(quick_results):
    results_dir, _ = quick_results
    for data in load_results(results_dir):
        assert data["tier"] == "quick" and isinstance(data["higher_is_better"], bool)
        settings = [s for panel in data["panels"].values() for s in panel["settings"]]
        assert settings and all(len(p["settings"]) == len(p["x"]) for p in data["panels"].values())
        for model, by_setting in data["results"].items():
            assert set(by_setting) == set(settings), (data["experiment"], model)
            assert all(v is None or v == v for v in by_setting.values())
        for run in data["runs"].values():
            assert run["model"] in data["results"] and set(run["values"]) <= set(settings)
        if data["kind"] == "train":
            exp = load_experiment(data["experiment"], quick=True, folder=FOLDER)
            assert len(data["runs"]) == len(expand(exp))
            for run in data["runs"].values():
                assert {"config", "num_parameters", "seconds", "seed", "steps", "peak_grad_norm",
                        "peak_grad_step"} <= set(run)
                assert run["peak_grad_norm"] > 0 and 1 <= run["peak_grad_step"] <= run["steps"]
                assert run["steps"] == exp.base["steps"]
                if "accuracy" in data["metric"]:
                    assert all(0 <= v <= 1 for v in run["values"].values())


def test_results_are_the_mean_over_seeds_of_the_runs(quick_results):
    results_dir, _ = quick_results
    data = json.loads((results_dir / "mqar.json").read_text())
    for model, by_setting in data["results"].items():
        for setting, value in by_setting.items():
            values = [r["values"][setting] for r in data["runs"].values()
                      if r["model"] == model and setting in r["values"]]
            assert value == pytest.approx(sum(values) / len(values))


def test_extra_models_are_rows_of_their_variant_with_their_changes(quick_results):
    """niah's extra rows: the LMM and MAC with a matrix memory beside the default deep one."""
    from titans.experiments.report import observations

    results_dir, _ = quick_results
    data = json.loads((results_dir / "niah.json").read_text())
    assert {"lmm depth1", "mac depth1"} <= set(data["results"])
    for label, variant in (("lmm depth1", "lmm"), ("mac depth1", "mac")):
        runs = [r for r in data["runs"].values() if r["model"] == label]
        assert runs and all(r["config"]["model"]["variant"] == variant and r["config"]["model"]["memory"]["depth"] == 1
                            for r in runs)
    data["results"]["lmm depth1"] = {s: 2.0 for s in data["results"]["lmm depth1"]}  # beats everything
    assert all("best Titans variant lmm depth1" in line for line in observations(data))


def test_a_finished_grid_is_read_back_not_trained_again(quick_results, tmp_path, monkeypatch):
    results_dir, runs_dir = quick_results
    before = json.loads((results_dir / "niah.json").read_text())

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr("titans.train.train", no_training)
    path = run_experiment(load_experiment("niah", quick=True, folder=FOLDER), tmp_path, runs_dir, jobs=1,
                          quick=True, quiet=True)
    after = json.loads(path.read_text())
    assert after["results"] == before["results"]


@pytest.mark.parametrize("name, point", [("capacity", "capacity_point"), ("efficiency", "efficiency_point")])
def test_measured_points_are_read_back_until_the_grid_changes(quick_results, tmp_path, monkeypatch, name, point):
    results_dir, runs_dir = quick_results
    before = json.loads((results_dir / f"{name}.json").read_text())
    failed = {run: r["status"] for run, r in before["runs"].items() if r.get("status", "ok") != "ok"}
    assert not failed, f"quick points failed (a failed point is measured again by design): {failed}"

    def no_measuring(*args, **kwargs):
        raise AssertionError("a measured point was measured again")

    monkeypatch.setattr(f"titans.experiments.measure.{point}", no_measuring)
    exp = load_experiment(name, quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, tmp_path, runs_dir, jobs=1, quick=True, quiet=True).read_text())
    assert after["results"] == before["results"]
    changed = exp.replace(**{name: {**getattr(exp, name).to_dict(), "batch_size": 3}})
    with pytest.raises(AssertionError, match="measured again"):
        run_experiment(changed, tmp_path, runs_dir, jobs=1, quick=True, quiet=True)


def spy_on_train(monkeypatch) -> list[dict]:
    """The keyword arguments of every `train` call the runner makes from now on (the runs still train)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return train(*args, **kwargs)

    monkeypatch.setattr("titans.train.train", spy)
    return calls


def fresh_clone_of(results_dir: Path, name: str, tmp_path: Path, edit=None) -> Path:
    """A results dir holding only `name`'s JSON (edited by `edit(data)`), as a fresh clone has it: no runs dir."""
    data = json.loads((results_dir / f"{name}.json").read_text())
    if edit is not None:
        edit(data)
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / f"{name}.json").write_text(json.dumps(data))
    return clone


def drop_evaluations(data):
    """A JSON as written before records kept their whole evaluation, and before a config field with its default
    (`compile`, standing for any added since) existed."""
    for record in data["runs"].values():
        record.pop("evaluation", None)
        record.pop("machine", None)
        assert record["config"].pop("compile") is False


@pytest.mark.parametrize("name", ["niah", "lm"])
@pytest.mark.parametrize("edit", [None, drop_evaluations])
def test_a_grid_continues_from_its_json_where_the_runs_are_gone(quick_results, tmp_path, monkeypatch, name, edit):
    """A fresh clone has the committed JSON and no runs directory: every run the JSON records is read back from it
    (from its values, in a JSON from before records kept their evaluation), positions in the context included."""
    results_dir, _ = quick_results
    before = json.loads((results_dir / f"{name}.json").read_text())
    clone = fresh_clone_of(results_dir, name, tmp_path, edit)
    calls = spy_on_train(monkeypatch)
    exp = load_experiment(name, quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, clone, tmp_path / "no-runs", jobs=1, quick=True, quiet=True).read_text())
    assert calls == [] and not (tmp_path / "no-runs").exists()
    assert after["results"] == before["results"] and after["spread"] == before["spread"]
    assert "pending" not in after
    for run_id, record in after["runs"].items():
        assert record["values"] == before["runs"][run_id]["values"]
        assert record["steps"] == before["runs"][run_id]["steps"] and record["evaluation"]


def test_a_rewrite_on_another_machine_keeps_the_machine_that_trained_the_runs(quick_results, tmp_path, monkeypatch):
    """`--no-train` (or a grid read back elsewhere) names the machine that trained most of the runs, not its own."""
    results_dir, _ = quick_results

    def trained_elsewhere(data):
        for i, record in enumerate(data["runs"].values()):
            record["machine"] = "machine A" if i else "machine B"

    clone = fresh_clone_of(results_dir, "niah", tmp_path, trained_elsewhere)
    calls = spy_on_train(monkeypatch)
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, clone, tmp_path / "no-runs", jobs=1, quick=True, quiet=True,
                                      only=[]).read_text())
    assert calls == [] and after["machine"] == "machine A"
    assert [r["machine"] for r in after["runs"].values()].count("machine B") == 1


def test_a_run_whose_config_changed_or_failed_is_trained_again_and_the_rest_read_back(quick_results, tmp_path,
                                                                                     monkeypatch):
    results_dir, _ = quick_results
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    changed, failed, *_ = [run.run_id for run in expand(exp)]

    def edit(data):
        data["runs"][changed]["config"]["optim"]["lr"] *= 2  # trained under another config than the grid's
        data["runs"][failed] = {**data["runs"][failed], "error": "RuntimeError: out of memory"}

    clone = fresh_clone_of(results_dir, "niah", tmp_path, edit)
    calls = spy_on_train(monkeypatch)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "runs" / "niah").iterdir()) == sorted([changed, failed])
    assert "error" not in after["runs"][failed] and set(after["runs"]) == {run.run_id for run in expand(exp)}


def test_a_run_is_read_back_from_any_record_of_its_config(quick_results, tmp_path, monkeypatch):
    """The config, not the row's name, is what a run is: a row renamed (or a default changed, so that one row's
    config is now another's) reads its runs back from the records of that config; a run's own record comes first,
    and a record of another config is never read."""
    results_dir, _ = quick_results
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    first, second = [run.run_id for run in expand(exp)][:2]

    def rename(data):
        data["runs"]["old-name-" + first] = data["runs"].pop(first)
        data["runs"]["other-config"] = {**data["runs"][second], "values": {"x": 0.5}}  # a config of another run
        data["runs"]["other-config"]["config"] = {**data["runs"][second]["config"], "seed": 99}

    before = json.loads((results_dir / "niah.json").read_text())
    clone = fresh_clone_of(results_dir, "niah", tmp_path, rename)
    calls = spy_on_train(monkeypatch)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert calls == [] and "pending" not in after
    assert set(after["runs"]) == {run.run_id for run in expand(exp)}  # filed under the grid's names
    assert after["runs"][first]["values"] == before["runs"][first]["values"]
    assert after["runs"][second]["values"] == before["runs"][second]["values"]

    def one_config_twice(data):  # two records of one config: the run's own is read
        data["runs"]["twin"] = {**data["runs"][first], "values": {"x": 0.5}, "evaluation": {"256": {"x": 0.5}}}

    (tmp_path / "twice").mkdir()
    clone = fresh_clone_of(results_dir, "niah", tmp_path / "twice", one_config_twice)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert calls == [] and after["runs"][first]["values"] == before["runs"][first]["values"]


def test_runs_of_an_earlier_config_are_shown_marked_stale_until_trained_again(quick_results, tmp_path, monkeypatch):
    """After a default or the grid changed, `--no-train` rewrites the JSON without training: a run recorded under
    the earlier config keeps its values and its config as trained, is pending and listed stale with the fields that
    changed, and the report says so; training it again clears the mark."""
    from titans.experiments.report import headline_row, section

    results_dir, _ = quick_results
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    changed = expand(exp)[0].run_id

    def edit(data):  # a record from before the field existed: it trained with the residual, the earlier default
        del data["runs"][changed]["config"]["model"]["memory"]["residual"]

    before = json.loads((results_dir / "niah.json").read_text())
    clone = fresh_clone_of(results_dir, "niah", tmp_path, edit)
    calls = spy_on_train(monkeypatch)
    result = CliRunner().invoke(app, ["experiment", "run", "niah", "--quick", "--no-train", "--results-dir",
                                      str(clone), "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0 and calls == []
    data = json.loads((clone / "niah.json").read_text())
    assert data["pending"] == [changed] and set(data["runs"]) == set(before["runs"])
    assert data["stale"] == {changed: ["model.memory.residual: true → false"]}
    assert "residual" not in data["runs"][changed]["config"]["model"]["memory"]  # the config as recorded
    assert data["runs"][changed]["values"] == before["runs"][changed]["values"]
    assert data["results"] == before["results"]
    total = len(before["runs"])
    text = section(data, clone / "niah.json", clone / "niah.png", clone)
    assert f"**Incomplete**: {total - 1} of {total} runs finished; 1 more are shown as trained under an earlier " \
           "config" in text and "model.memory.residual: true → false (1 runs)" in text
    row = data["runs"][changed]["model"]  # the README's table leaves the stale row out, and only it
    panel = next(iter(data["panels"]))
    setting = data["panels"][panel]["settings"][-1]
    cells = {m: f"{m} {fmt(v[setting], data['metric'])}" for m, v in data["results"].items()
             if v.get(setting) is not None}
    head = headline_row(data, panel, tuple(data["results"]), (), "RESULTS.md") or ""
    assert cells[row] not in head and all(cell in head for m, cell in cells.items() if m != row)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert len(calls) == 1 and "stale" not in after and "pending" not in after
    assert after["runs"][changed]["config"]["model"]["memory"]["residual"] is False


def flat_record(model: dict) -> dict:
    """A model config as records were written before the memory section (format version 1): its fields flat, the
    memory's and the attention's."""
    flat = {old: model[section][new] for section, fields in FLAT_FIELDS.items() for old, new in fields.items()
            if new in model[section]}
    return {**{key: value for key, value in model.items() if key not in FLAT_FIELDS}, **flat}


def test_records_written_flat_are_read_back_as_the_same_runs(quick_results, tmp_path, monkeypatch):
    """Results JSONs written before the memory section hold flat model configs (`memory_depth`, `chunk_size`, ...):
    a grid reads them back as the runs they are, nothing pending and nothing stale, and rewrites them nested."""
    results_dir, _ = quick_results
    before = json.loads((results_dir / "niah.json").read_text())

    def flatten(data):
        for record in data["runs"].values():
            record["config"]["model"] = flat_record(record["config"]["model"])

    clone = fresh_clone_of(results_dir, "niah", tmp_path, flatten)
    assert "memory_depth" in json.loads((clone / "niah.json").read_text())["runs"][next(iter(before["runs"]))][
        "config"]["model"]
    calls = spy_on_train(monkeypatch)
    result = CliRunner().invoke(app, ["experiment", "run", "niah", "--quick", "--no-train", "--results-dir",
                                      str(clone), "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0 and calls == []
    data = json.loads((clone / "niah.json").read_text())
    assert "pending" not in data and "stale" not in data and data["results"] == before["results"]
    assert all(record["config"] == before["runs"][run_id]["config"] for run_id, record in data["runs"].items())


def test_a_committed_grid_keeps_its_current_stale_and_pending_runs(tmp_path, monkeypatch):
    """The runner decides which runs are current by comparing configs: the committed `niah` grid (records written
    flat, before the memory section; runs trained under an earlier default among them), rewritten with --no-train,
    has exactly the pending and stale runs its JSON names, each stale for the same fields (now spelled as paths in the
    memory section)."""
    committed = json.loads((ROOT / "docs" / "results" / "niah.json").read_text())
    clone = tmp_path / "results"
    clone.mkdir()
    (clone / "niah.json").write_text(json.dumps(committed))
    calls = spy_on_train(monkeypatch)
    result = CliRunner().invoke(app, ["experiment", "run", "niah", "--no-train", "--results-dir", str(clone),
                                      "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    assert calls == []
    data = json.loads((clone / "niah.json").read_text())
    # rows added to the grid since the JSON was committed (titans-pytorch's) are pending whole, the rest as committed
    known = set(committed["runs"]) | set(committed.get("pending", []))
    assert [run_id for run_id in data.get("pending", []) if run_id in known] == committed.get("pending", [])
    added = {run.model for run in expand(load_experiment("niah", folder=FOLDER))
             if run.run_id in set(data.get("pending", [])) - known}
    assert not added & set(committed["results"])
    assert set(data.get("runs", {})) == set(committed["runs"])

    def nested_path(change: str) -> str:  # 'model.memory_residual: true → false' -> 'model.memory.residual: ...'
        field, _, rest = change.partition(": ")
        name = field.removeprefix("model.")
        return f"model.{flat_field_path(name)}: {rest}" if field.startswith("model.") and flat_field_path(name) \
            else change

    expected = {run_id: [nested_path(c) for c in changes] for run_id, changes in committed.get("stale", {}).items()}
    assert data.get("stale", {}) == expected


def test_a_new_seed_trains_the_new_runs_only_and_the_json_follows_each_run(quick_results, tmp_path, monkeypatch):
    """Adding a seed trains the new seed's runs; the JSON is rewritten after each finished run, the runs not yet
    finished under "pending", so a killed grid keeps what it finished in the JSON."""
    results_dir, _ = quick_results
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    seeded = exp.replace(seeds=[*exp.seeds, 7])
    new = [run.run_id for run in expand(seeded) if run.seed == 7]
    clone = fresh_clone_of(results_dir, "niah", tmp_path)
    seen_pending = []

    def spy(cfg, run_dir, **kwargs):
        seen_pending.append(json.loads((clone / "niah.json").read_text()).get("pending"))
        return train(cfg, run_dir, **kwargs)

    monkeypatch.setattr("titans.train.train", spy)
    after = json.loads(run_experiment(seeded, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert len(seen_pending) == len(new)
    assert seen_pending[1:] == [new[i:] for i in range(1, len(new))]  # the JSON before each run after the first
    assert "pending" not in after and {r["seed"] for r in after["runs"].values()} == {*exp.seeds, 7}
    assert all(after["spread"][model] for model in after["results"])


def test_retrain_trains_every_run_again(quick_results, tmp_path, monkeypatch):
    results_dir, runs_dir = quick_results
    exp = load_experiment("long", quick=True, folder=FOLDER)
    clone = fresh_clone_of(results_dir, "long", tmp_path)
    shutil.copytree(runs_dir / "long", tmp_path / "runs" / "long")
    calls = spy_on_train(monkeypatch)
    run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, retrain=True)
    assert len(calls) == len(expand(exp)) and all(call["force"] and not call["resume"] for call in calls)



def test_only_some_rows_train_and_the_rest_stay_pending_or_as_recorded(quick_results, tmp_path, monkeypatch):
    """`only` trains the runs of the rows named: in an empty results dir the rest are pending; over a full JSON with
    `retrain`, those rows train again and the others are read back; an unknown row is an error naming the rows."""
    results_dir, runs_dir = quick_results
    exp = load_experiment("niah", quick=True, folder=FOLDER)
    rows = list(dict.fromkeys(run.model for run in expand(exp)))
    mine = [run.run_id for run in expand(exp) if run.model == rows[0]]
    calls = spy_on_train(monkeypatch)
    first = json.loads(run_experiment(exp, tmp_path / "empty", runs_dir, jobs=1, quick=True, quiet=True,
                                      only=[rows[0]]).read_text())
    assert set(first["runs"]) == set(mine) and len(first["pending"]) == len(expand(exp)) - len(mine)
    assert calls == []  # the runs directory held them finished
    clone = fresh_clone_of(results_dir, "niah", tmp_path)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, retrain=True,
                                      only=[rows[0]]).read_text())
    assert len(calls) == len(mine) and "pending" not in after and set(after["runs"]) == {r.run_id for r in expand(exp)}
    with pytest.raises(ValueError, match=r"has no rows or runs \['nope'\]; its rows are"):
        run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, only=["nope"])


def test_only_takes_globs_over_run_ids(quick_results, tmp_path, monkeypatch):
    """A glob in `only` picks runs across rows (one panel, one seed); with a row label the union trains; a run id
    picks that run; a glob that matches no run is an error naming the ids' form, before anything trains."""
    results_dir, _ = quick_results
    exp = load_experiment("mqar", quick=True, folder=FOLDER)
    runs = expand(exp)
    pattern = "*-dim32-*-s0"  # every row's runs of one width
    picked = [run.run_id for run in runs if "-dim32-" in run.run_id]
    assert 1 < len({run.model for run in runs if run.run_id in picked}) and len(picked) < len(runs)
    calls = spy_on_train(monkeypatch)
    clone = fresh_clone_of(results_dir, "mqar", tmp_path)
    run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, retrain=True, only=[pattern])
    assert len(calls) == len(picked)
    calls.clear()
    row = runs[0].model
    union = set(picked) | {run.run_id for run in runs if run.model == row}
    run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, retrain=True,
                   only=[pattern, row])
    assert len(calls) == len(union)
    calls.clear()
    run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, retrain=True,
                   only=[picked[0]])  # a run id alone
    assert len(calls) == 1
    calls.clear()
    with pytest.raises(ValueError, match=r"no rows or runs \['zz\*'\]; its rows are .*its run ids look like"):
        run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True, only=["zz*"])
    assert calls == []

def test_an_incomplete_grid_and_runs_from_several_machines_are_said_in_the_report(quick_results, tmp_path):
    from titans.experiments.report import headline_row, section

    results_dir, _ = quick_results
    data = json.loads((results_dir / "niah.json").read_text())
    first, *rest = data["runs"]
    data["pending"] = rest
    data["runs"] = {first: {**data["runs"][first], "machine": "machine A"}}
    text = section(data, results_dir / "niah.json", results_dir / "niah.png", results_dir)
    assert f"**Incomplete**: 1 of {1 + len(rest)} runs finished" in text
    row = headline_row(data, next(iter(data["panels"])), ("lmm",), ("transformer",), "RESULTS.md")
    assert f"incomplete, 1 of {1 + len(rest)} runs finished" in row
    data["runs"]["other"] = {**data["runs"][first], "machine": "machine B"}
    text = section(data, results_dir / "niah.json", results_dir / "niah.png", results_dir)
    assert "machine A (1 runs); machine B (1 runs)" in text


def test_a_killed_run_continues_from_its_checkpoint(tmp_path, monkeypatch):
    run = expand(load_experiment("long", quick=True, folder=FOLDER))[0]
    cfg = run.config.replace(steps=4, checkpoint_every=2)
    run_dir = tmp_path / run.run_id
    train(cfg.replace(steps=2), run_dir, quiet=True)  # stands for the run killed after its step-2 checkpoint:
    (run_dir / "eval.json").unlink()  # no result yet, and the run directory's config is the 4-step run's
    cfg.to_yaml(run_dir / "config.yaml")
    assert resumable(cfg, run_dir) and not resumable(cfg.replace(seed=1), run_dir)
    calls = spy_on_train(monkeypatch)
    done = train_one(cfg, run_dir)
    assert done["step"] == 4 and calls[0]["resume"] and not calls[0]["force"]
    assert not resumable(cfg, run_dir)  # finished now
    assert train_one(cfg, run_dir) == done and len(calls) == 1


def test_the_time_budget_limits_a_run_without_keying_it(tmp_path, monkeypatch):
    """A run that met its steps is read back under any budget; one its budget cut short is read back under that
    budget and continued from its checkpoint under another."""
    run = expand(load_experiment("long", quick=True, folder=FOLDER))[0]
    cfg = run.config.replace(steps=4, checkpoint_every=2, time_budget_s=1000.0)
    run_dir = tmp_path / run.run_id
    train(cfg.replace(steps=2), run_dir, quiet=True)  # stands for the run its budget stopped at step 2:
    cfg.to_yaml(run_dir / "config.yaml")  # its config is the 4-step run's
    assert finished(cfg, run_dir)["step"] == 2 and not resumable(cfg, run_dir)
    longer = cfg.replace(time_budget_s=5000.0)
    assert finished(longer, run_dir) is None and resumable(longer, run_dir)
    calls = spy_on_train(monkeypatch)
    done = train_one(longer, run_dir)
    assert done["step"] == 4 and calls[0]["resume"] and not calls[0]["force"]
    assert train_one(cfg.replace(time_budget_s=None), run_dir) == done and len(calls) == 1  # complete: any budget


def test_a_failed_run_is_recorded_and_the_grid_goes_on(tmp_path):
    run = expand(load_experiment("long", quick=True, folder=FOLDER))[0]
    blocker = tmp_path / "file"
    blocker.write_text("not a run directory")
    summary = _train_or_error(run.config, blocker)
    assert "error" in summary and blocker.read_text() == "not a run directory"


def test_a_finished_run_is_described_by_the_experiments_metric():
    summary = {"step": 1000, "train_seconds": 359.7, "results": {
        "64": {"loss": 3.83, "accuracy": 0.0, "token_accuracy": 0.127}}}
    assert describe_run(summary, "token_accuracy") == "1000 steps in 360 s; token_accuracy 64: 0.127"
    assert describe_run(summary, "bits_per_byte") == "1000 steps in 360 s; loss 64: 3.830"  # not measured: the loss
    assert describe_run({"error": "ValueError: bad"}, "accuracy") == "ValueError: bad"


def test_report_is_written_from_the_json_alone(quick_results, tmp_path):
    results_dir, _ = quick_results
    copied = tmp_path / "results"
    shutil.copytree(results_dir, copied)
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{README_START}\nold block\n{README_END}\noutro\n")
    out = write_report(copied, tmp_path / "RESULTS.md", readme)
    text = out.read_text()
    for data in load_results(copied):
        assert data["title"] in text and (copied / f"{data['experiment']}.png").stat().st_size > 1000
        assert data["command"] in text
    mqar = json.loads((copied / "mqar.json").read_text())
    value = mqar["results"]["lstm"]["dim16/2"]
    assert f"{value:.2f}" in text
    block = readme.read_text()
    assert block.startswith("intro\n") and block.endswith("outro\n") and "old block" not in block
    assert "RESULTS.md" in block and block.count("| result | Titans |") == 1  # one table; the grids: RESULTS.md


def test_a_grid_with_nothing_trained_yet_is_reported_without_a_plot(quick_results, tmp_path):
    """A grid just added (every run pending) has no panel to plot: its section says so, and no PNG is written or
    left from before."""
    results_dir, _ = quick_results
    copied = tmp_path / "results"
    shutil.copytree(results_dir, copied)
    data = json.loads((copied / "mqar.json").read_text())
    data["pending"] = sorted(data["runs"])
    data.update(experiment="untrained", runs={}, results={}, spread={}, panels={})
    (copied / "untrained.json").write_text(json.dumps(data))
    (copied / "untrained.png").write_bytes(b"an old plot")
    text = write_report(copied, tmp_path / "RESULTS.md").read_text()
    section = text[text.index("untrained.json"):]
    assert "**Incomplete**" in section.split("\n## ")[0]
    assert not (copied / "untrained.png").exists() and "untrained.png" not in text


def test_the_hand_written_notes_of_results_md_survive_a_report(tmp_path):
    """RESULTS.md from NOTES_START on is the notes behind DESIGN.md's choices: a report rewrites every table above it
    and keeps them as they are (and writes none where there were none)."""
    from titans.experiments.report import NOTES_START

    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(ROOT / "docs" / "results" / "long.json", results)
    out = tmp_path / "RESULTS.md"
    assert NOTES_START not in write_report(results, out).read_text()
    notes = f"{NOTES_START}\n\n## Notes\n\nA probe, its command.\n"
    out.write_text("an old table\n\n" + notes)
    text = write_report(results, out).read_text()
    assert text.endswith("\n" + notes) and "an old table" not in text and "Long context" in text
    assert write_report(results, out).read_text() == text  # a second report changes nothing


def test_the_readme_headline_is_one_table_of_current_rows_each_with_its_command():
    """From the committed results: a row per claim of HEADLINE, its value read from the JSON at the panel's largest x,
    the command that wrote the JSON beside it; a row trained under an earlier config (stale) never reaches the
    README, and a claim left with no current Titans row is left out whole."""
    from titans.experiments.report import HEADLINE, headline

    experiments = load_results(ROOT / "docs" / "results")
    table = headline(experiments, "docs/RESULTS.md")
    assert table.count("| result | Titans |") == 1 and "(stale)" not in table and "docs/RESULTS.md" in table
    long = next(d for d in experiments if d["experiment"] == "long")
    assert f"lmm {fmt(long['results']['lmm']['16384'], 'accuracy')}" in table
    assert "`titans experiment run long`" in table
    niah = next(d for d in experiments if d["experiment"] == "niah")
    assert ("niah", "passkey") in {(name, panel) for name, panel, _, _ in HEADLINE}
    current = [m for m in ("lmm", "mac", "mag", "mal") if m not in stale_rows(niah)]
    assert ("S-NIAH" in table) == bool(current)
    lmm, mac = (f"{m} {fmt(long['results'][m]['16384'], 'accuracy')}" for m in ("lmm", "mac"))
    long["stale"] = {run_id: ["a change"] for run_id, r in long["runs"].items() if r.get("model") == "lmm"}
    assert lmm not in headline(experiments, "RESULTS.md") and mac in headline(experiments, "RESULTS.md")


def test_runs_the_time_budget_stopped_short_are_named(quick_results, tmp_path):
    """A run cut by its time budget trained less than the others: the report says which, with its steps."""
    results_dir, _ = quick_results
    copied = tmp_path / "results"
    shutil.copytree(results_dir, copied)
    path = copied / "babilong.json"
    data = json.loads(path.read_text())
    run_id, run = next(iter(data["runs"].items()))
    assert f"{run_id} (" not in write_report(copied, tmp_path / "RESULTS.md").read_text()
    run["steps"] = run["config"]["steps"] - 1
    path.write_text(json.dumps(data))
    text = write_report(copied, tmp_path / "RESULTS.md").read_text()
    steps = f"({run['steps']} of {run['config']['steps']})"
    assert f"Stopped by the time budget before their steps: {run_id} {steps}" in text


def test_the_largest_gradient_norm_and_bound_share_of_each_model_are_in_the_table_of_runs(quick_results, tmp_path):
    """A gradient spike that clipping absorbed is named with its run's seed and step, and the largest share of
    learned θ_t that the momentum-gain bound lowered with its seed; runs recorded before the fields existed (or that
    bounded nothing) show a dash, not a number."""
    results_dir, _ = quick_results
    copied = tmp_path / "results"
    shutil.copytree(results_dir, copied)
    path = copied / "babilong.json"
    data = json.loads(path.read_text())
    model = next(iter(data["runs"].values()))["model"]
    spiked = [r for r in data["runs"].values() if r["model"] == model]
    spiked[0].update(peak_grad_norm=1.5e6, peak_grad_step=2, momentum_bound_share=0.025)
    other = next(r["model"] for r in data["runs"].values() if r["model"] != model)
    for r in data["runs"].values():
        if r["model"] == other:
            r.pop("peak_grad_norm"), r.pop("peak_grad_step"), r.pop("momentum_bound_share", None)
    path.write_text(json.dumps(data))
    text = write_report(copied, tmp_path / "RESULTS.md").read_text()
    section = text[text.index("## BABILong"):]

    def runs_row(name):  # the table of runs: eight columns
        return next(line for line in section.splitlines() if line.startswith(f"| {name} |") and line.count("|") == 9)

    assert f"| 1.5e+06 (s{spiked[0]['seed']}: 2) | 2.50% (s{spiked[0]['seed']}) |" in runs_row(model)
    assert "| — | — |" in runs_row(other)


def test_report_prints_accuracies_to_two_decimals_and_losses_to_three_digits():
    assert (fmt(0.8125, "accuracy"), fmt(0.5, "token_accuracy")) == ("0.81", "0.50")
    assert (fmt(0.034282, "loss"), fmt(0.029310, "loss")) == ("0.0343", "0.0293")  # not both "0.03"
    assert (fmt(2.4849, "bits_per_byte"), fmt(2.4951, "bits_per_byte")) == ("2.485", "2.495")  # not 2.48 and 2.5
    assert (fmt(1.8712, "loss"), fmt(64.0, "capacity")) == ("1.87", "64")
    assert (fmt(12345.6, "tokens_per_s"), fmt(None, "loss")) == ("12,346", "failed")


def test_plot_of_models_takes_a_mean_an_ulp_outside_its_seeds_range():
    """Equal values average to a mean that floating point may put just above their maximum (wind's persistence row,
    one value per run, 30 runs): the bar is empty, not an error."""
    import matplotlib.pyplot as plt

    value = 0.019677634710130936
    mean = sum([value] * 30) / 30
    assert mean > value  # the case itself
    data = {"experiment": "x", "metric": "loss", "results": {"persistence": {"s": mean}},
            "spread": {"persistence": {"s": [value, value]}}}
    fig, ax = plt.subplots()
    plot_models(ax, data, {"settings": ["s"], "x": [1]}, "panel")
    plt.close(fig)


def test_a_grid_of_many_rows_is_plotted_a_row_per_model(tmp_path):
    """An ablation grid (39 rows) gets a labelled row per model, a marker per column, and its legend below the panels;
    lines over two columns could not be told apart, nor their legend fit in the axes."""
    import warnings

    import matplotlib
    import matplotlib.pyplot as plt

    from titans.experiments.report import MANY_ROWS, plot, plot_rows

    models = [f"row {i}" for i in range(MANY_ROWS + 3)]
    panel = {"settings": ["256", "1024"], "x": [256, 1024]}
    data = {"experiment": "x", "title": "x", "metric": "bits_per_byte", "higher_is_better": False,
            "x_label": "context length (bytes)", "panels": {"": panel},
            "results": {m: {"256": 2.0 + i / 100, "1024": 2.1 + i / 100} for i, m in enumerate(models)}}
    data["results"]["row 1"] = {"256": 2.5}  # a row missing a column keeps its place
    matplotlib.use("Agg")
    fig, ax = plt.subplots()
    plot_rows(ax, data, panel, "")
    assert [t.get_text() for t in ax.get_yticklabels()] == models
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # the first row on top, as in the table
    assert [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")] == [
        "context length (bytes) 256", "context length (bytes) 1024"]
    plt.close(fig)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the layout fits: no "tight layout not applied"
        plot(data, tmp_path / "x.png")
    assert (tmp_path / "x.png").stat().st_size > 0


def test_report_refuses_bad_input_and_changes_nothing(tmp_path):
    with pytest.raises(ValueError, match="no results JSON"):
        write_report(tmp_path, tmp_path / "RESULTS.md")
    (tmp_path / "x.json").write_text('{"experiment": "x"}')
    with pytest.raises(ValueError, match="missing"):
        write_report(tmp_path, tmp_path / "RESULTS.md")
    assert not (tmp_path / "RESULTS.md").exists()


def test_readme_without_the_block_is_left_alone(quick_results, tmp_path):
    results_dir, _ = quick_results
    readme = tmp_path / "README.md"
    readme.write_text("no markers here\n")
    with pytest.raises(ValueError, match="experiments:start"):
        write_report(results_dir, tmp_path / "RESULTS.md", readme)
    assert readme.read_text() == "no markers here\n" and not (tmp_path / "RESULTS.md").exists()


def test_capacity_reader_writes_and_reads_a_matrix_memory():
    """One pass of the default rule into a depth-1 memory recalls a few random pairs; far more pairs than the
    head width cannot all be held."""
    predict = memory_reader(64, 1, 1, 1, theta=0.5, vocab=1026)
    result = measure_capacity(predict, [4, 512], threshold=0.9, vocab=1026, batch_size=4)
    assert result.accuracy[4] >= 0.9 and result.accuracy[512] < 0.9


def test_cli_lists_runs_and_reports(quick_results, tmp_path):
    runner = CliRunner()
    listed = runner.invoke(app, ["experiment", "list"])
    assert listed.exit_code == 0 and all(name in listed.output for name in ISSUE_EXPERIMENTS)
    bad = runner.invoke(app, ["experiment", "run", "no-such-experiment"])
    assert bad.exit_code == 2 and "no experiment" in bad.output
    rows = runner.invoke(app, ["experiment", "run", "capacity", "--quick", "--only", "lmm", "--results-dir",
                               str(tmp_path / "untouched")])
    assert rows.exit_code == 2 and "--only is for a training grid" in rows.output
    assert not (tmp_path / "untouched").exists()
    results_dir, _ = quick_results
    report = runner.invoke(app, ["experiment", "report", "--results-dir", str(results_dir),
                                 "--out", str(tmp_path / "R.md"), "--no-update-readme"])
    assert report.exit_code == 0, report.output
    assert (tmp_path / "R.md").is_file()


def test_published_figures_stand_beside_ours_never_among_them(quick_results):
    from titans.experiments.report import published_table

    results_dir, _ = quick_results
    data = json.loads((results_dir / "sine.json").read_text())
    assert data["published"]["values"]["swa"] == 0.0365 and "the proof-of-concept" in data["published"]["source"]
    assert {"mac", "swa", "mac depth1"} <= set(data["results"])  # the quick tier's rows: ours only
    table = published_table(data)
    assert "| swa | " in table and " | 0.0365 |" in table and "| lstm | not run | 0.0156 |" in table


def test_a_baseline_row_is_what_the_runs_report_for_it(quick_results, tmp_path):
    """wind's persistence row: no run of its own, the mean of the persistence loss the runs' evaluations report (on
    the sequences their models were scored on), named as no model in the report."""
    from titans.experiments.report import section

    results_dir, runs_dir = quick_results
    data = json.loads((results_dir / "wind.json").read_text())
    assert data["baselines"] == {"persistence": "persistence_loss"}
    assert "persistence" not in {run["model"] for run in data["runs"].values()}
    (setting,) = data["panels"][""]["settings"]
    reported = [json.loads((runs_dir / "wind" / run_id / "eval.json").read_text())["results"]["24"]["persistence_loss"]
                for run_id in data["runs"]]
    assert len(reported) == 2 and data["results"]["persistence"][setting] == pytest.approx(sum(reported) / 2)
    assert "Rows that are no trained model: persistence (`persistence_loss`)" in \
        section(data, results_dir / "wind.json", tmp_path / "wind.png", tmp_path)
    (tmp_path / "b.yaml").write_text("tasks: {a: {name: passkey}}\nvariants: [lmm]\nbaselines: {persistence: "
                                     "persistence_loss}\n")
    exp = load_experiment("b", folder=tmp_path)
    summary = {"results": {"256": {"loss": 1.0, "accuracy": 0.5}}, "num_parameters": 1, "step": 1, "train_seconds": 1}
    with pytest.raises(ValueError, match="'persistence_loss', which run lmm-a-s0's evaluation does not report \\(it "
                                         "reports loss, accuracy\\)"):
        train_results(exp, expand(exp), [summary])


def test_a_heat_map_over_two_model_settings(quick_results, tmp_path):
    """sine's gate grid: the rows that set both fields are the cells (the data-gated MAC stays in the table only)."""
    from titans.experiments.report import heatmap_cells, plot

    results_dir, _ = quick_results
    data = json.loads((results_dir / "sine.json").read_text())
    assert data["heatmap"] == {"x": "memory.init_theta", "y": "memory.init_eta"}
    xs, ys, cells = heatmap_cells(data)
    assert xs == [0.1, 0.5] and ys == [0.5] and set(cells) == {(0.1, 0.5), (0.5, 0.5)}
    # records written flat, and axes named flat (as older JSONs have both), give the same map
    older = {**data, "heatmap": {"x": "memory_init_theta", "y": "memory_init_eta"},
             "runs": {run_id: {**r, "config": {**r["config"], "model": flat_record(r["config"]["model"])}}
                      for run_id, r in data["runs"].items()}}
    assert heatmap_cells(older) == (xs, ys, cells)
    setting = data["panels"][""]["settings"][-1]
    assert cells[(0.5, 0.5)] == data["results"]["const theta0.5 eta0.5"][setting]
    plot(data, tmp_path / "sine.png")
    assert (tmp_path / "sine.png").stat().st_size > 1000


BAD_EXPERIMENTS = {
    "bad": ("tasks: {a: {name: passkey}}\nvariants: [lmm, gpt]\n", "gpt"),
    "other": ("name: different\n", "must be the file's name"),
    "typo": ("tasks: {a: {name: passkey}}\nseeds: [0, 0]\n", "seeds"),
    "extra": ("tasks: {a: {name: passkey}}\nextra_models: {big: {dim: 64}}\n", "big must name its variant"),
    "clash": ("tasks: {a: {name: passkey}}\nextra_models: {mac: {variant: mac}}\n", "not a variant's name"),
    "task": ("tasks: {a: {name: passkey, options: {vocab: 2}}}\n", "run lmm-s0|vocab"),  # found when expanded
    "twins": ("tasks: {a: {name: passkey}, x-a: {name: passkey}}\nvariants: [lmm]\n"
              "extra_models: {lmm x: {variant: lmm}}\n", "share a directory"),  # lmm + x-a, lmm x + a
    "half map": ("tasks: {a: {name: passkey}}\nheatmap: {x: memory_init_theta}\n", "both x and y"),
    "map axis": ("tasks: {a: {name: passkey}}\nheatmap: {x: theta, y: memory_init_eta}\n", "model fields"),
    "quoted": ("tasks: {a: {name: passkey}}\npublished: {values: {lmm: 0.5}}\n", "source"),
    "stray": ("tasks: {a: {name: passkey}}\npublished: {source: x, values: {gpt: 0.5}}\n", "rows not in the grid"),
    "baseline": ("tasks: {a: {name: passkey}}\nbaselines: {swa: loss}\n", "new row label"),
    "rows": ("tasks: {a: {name: passkey}}\nmodels_from: stray\nvariants: [lmm]\n", "cannot be set beside it"),
    "self": ("tasks: {a: {name: passkey}}\nmodels_from: self\n", "an experiment with rows of its own"),
}


@pytest.mark.parametrize("name", sorted(BAD_EXPERIMENTS))
def test_bad_experiment_files_name_the_problem(tmp_path, name):
    text, message = BAD_EXPERIMENTS[name]
    (tmp_path / f"{name}.yaml").write_text(text)
    with pytest.raises(ValueError, match=message):
        expand(load_experiment(name, folder=tmp_path))


def test_streamed_evaluation_matches_whole_sequences():
    from titans.train import EvalPlan, evaluate

    exp = load_experiment("long", quick=True, folder=FOLDER)
    for run in expand(exp):
        cfg = run.config
        task = build_task(cfg)
        torch.manual_seed(0)
        model = build_model(cfg, task).double()
        whole = evaluate(model, task, [64], EvalPlan(1, 2))
        pieces = evaluate(model, task, [64], EvalPlan(1, 2, piece=7))
        assert pieces[64]["loss"] == pytest.approx(whole[64]["loss"], rel=1e-9)


def test_lm_carries_bits_per_byte_against_position(quick_results, tmp_path):
    """Each evaluation length adds a panel of bits per byte over spans of positions, read from the runs' eval.json;
    the report tabulates it, says each model's first span against its last, and leaves it out of the headline."""
    from titans.experiments.report import headline, observations

    results_dir, runs_dir = quick_results
    data = json.loads((results_dir / "lm.json").read_text())
    exp = load_experiment("lm", quick=True, folder=FOLDER)
    buckets = exp.base["eval_position_buckets"]
    for length in exp.eval_lengths:
        panel = data["panels"][f"bits_per_byte by position at {length}"]
        assert panel["positions_of"] == str(length) and panel["x"] == [length * (i + 1) / buckets
                                                                      for i in range(buckets)]
        for run_id, run in data["runs"].items():
            kept = json.loads((runs_dir / "lm" / run_id / "eval.json").read_text())["results"][str(length)]
            assert [run["values"][s] for s in panel["settings"]] == kept["bits_per_byte_by_position"]
    assert sum("the first span of positions" in line for line in observations(data)) == len(exp.eval_lengths)
    assert "by position" not in headline([data], "RESULTS.md")
    write_report(results_dir, tmp_path / "RESULTS.md")
    assert "bits_per_byte by position at 128:" in (tmp_path / "RESULTS.md").read_text()


def test_continual_measures_the_lm_runs_and_reads_them_back(quick_results, tmp_path, monkeypatch):
    """continual's rows are lm's trained runs (the same directories: trained once, whichever experiment ran first);
    a second run neither trains nor measures again; the drop is the first reading less the second."""
    results_dir, runs_dir = quick_results
    data = json.loads((results_dir / "continual.json").read_text())
    lm = json.loads((results_dir / "lm.json").read_text())
    assert set(data["runs"]) == set(lm["runs"]) and data["kind"] == "continual"
    for run_id, run in data["runs"].items():
        assert run["source"] == f"lm/{run_id}" and run["num_parameters"] == lm["runs"][run_id]["num_parameters"]
        for gap in data["grid"]["gaps"]:
            first, second = run["values"][f"first reading/{gap}"], run["values"][f"second reading/{gap}"]
            assert 0 < second and run["values"][f"drop/{gap}"] == pytest.approx(first - second)

    def no_work(*args, **kwargs):
        raise AssertionError("trained or measured again")

    monkeypatch.setattr("titans.train.train", no_work)
    monkeypatch.setattr("titans.experiments.continual.continual_point", no_work)
    again = run_experiment(load_experiment("continual", quick=True, folder=FOLDER), tmp_path, runs_dir, jobs=1,
                           quick=True, quiet=True)
    assert json.loads(again.read_text())["results"] == data["results"]


def test_continual_on_a_fresh_clone_reads_its_json_and_measures_only_changed_models(quick_results, tmp_path,
                                                                                    monkeypatch):
    """A fresh clone has continual.json but not lm's trained runs: a model whose measurement the JSON holds for its
    config is read back, not trained and measured again; one whose config changed since (a default) is; a changed
    grid measures every model again."""
    results_dir, _ = quick_results
    before = json.loads((results_dir / "continual.json").read_text())
    changed, *kept = list(before["runs"])

    def earlier_default(data):
        data["runs"][changed]["config"]["model"]["memory"]["residual"] = True  # trained before the default changed

    clone = fresh_clone_of(results_dir, "continual", tmp_path, earlier_default)
    calls = spy_on_train(monkeypatch)
    exp = load_experiment("continual", quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert len(calls) == 1 and [p.name for p in (tmp_path / "runs" / "lm").iterdir()] == [changed]  # trained here
    for run_id in kept:
        assert after["runs"][run_id] == before["runs"][run_id]
    assert after["runs"][changed]["config"]["model"]["memory"]["residual"] is False
    assert after["results"].keys() == before["results"].keys()

    retrained = spy_on_train(monkeypatch)
    other = exp.replace(continual={**exp.continual.to_dict(), "passage": exp.continual.passage + 1})
    run_experiment(other, clone, tmp_path / "runs-2", jobs=1, quick=True, quiet=True)
    assert len(retrained) == len(before["runs"])


def test_continual_under_no_train_shows_a_changed_model_stale_and_measures_nothing(quick_results, tmp_path,
                                                                                monkeypatch):
    """As the training and measuring grids do under --no-train: a model measured under an earlier default keeps its
    recorded values, marked stale with what changed (so the report says so); nothing is trained or measured; the
    other models are read back as they were."""
    results_dir, _ = quick_results
    before = json.loads((results_dir / "continual.json").read_text())
    changed, *kept = list(before["runs"])

    def earlier_default(data):
        data["runs"][changed]["config"]["model"]["memory"]["residual"] = True

    clone = fresh_clone_of(results_dir, "continual", tmp_path, earlier_default)

    def no_work(*args, **kwargs):
        raise AssertionError("trained or measured")

    monkeypatch.setattr("titans.train.train", no_work)
    monkeypatch.setattr("titans.experiments.continual.continual_point", no_work)
    result = CliRunner().invoke(app, ["experiment", "run", "continual", "--quick", "--no-train", "--results-dir",
                                      str(clone), "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    after = json.loads((clone / "continual.json").read_text())
    assert after["stale"] == {changed: ["model.memory.residual: true → false"]} and after["pending"] == [changed]
    assert after["runs"][changed]["values"] == before["runs"][changed]["values"]
    assert all(after["runs"][run_id] == before["runs"][run_id] for run_id in kept)
    assert after["results"] == before["results"] and not (tmp_path / "runs").exists()
    write_report(clone, tmp_path / "RESULTS.md")
    report = (tmp_path / "RESULTS.md").read_text()
    assert "1 more are shown as trained under an earlier config" in report
    assert f"{before['runs'][changed]['model']} (stale)" in report


def test_continual_takes_the_source_rows_it_names_not_extra_models_of_their_variant(quick_results, tmp_path,
                                                                                   monkeypatch):
    """An extra model of the source (lm's "mac paper order" is a MAC) is a row of its own: continual measures the rows
    its `variants` name, so a source grown by such a row trains and measures nothing more."""
    results_dir, runs_dir = quick_results
    before = json.loads((results_dir / "continual.json").read_text())
    lm = load_experiment("lm", quick=True, folder=FOLDER)
    grown = lm.replace(extra_models={"lmm wide": {"variant": "lmm", "dim": 24}})
    assert any(run.model == "lmm wide" for run in expand(grown))
    monkeypatch.setattr("titans.experiments.continual.load_experiment", lambda name, quick=False: grown)
    calls = spy_on_train(monkeypatch)
    exp = load_experiment("continual", quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, fresh_clone_of(results_dir, "continual", tmp_path), runs_dir, jobs=1,
                                      quick=True, quiet=True).read_text())
    assert calls == [] and set(after["runs"]) == set(before["runs"])


def test_a_task_that_cannot_be_built_stops_the_grid_before_it_writes(tmp_path, monkeypatch):
    """Missing data (here a weather folder that does not exist; an optional extra not installed fails the same way)
    is an error naming it before any run trains, and the committed JSON is left as it was, not overwritten with one
    failed run per grid point."""
    exp = load_experiment("wind", quick=True, folder=FOLDER)
    missing = str(tmp_path / "no-such-folder")
    exp = exp.replace(tasks={name: {**axis.to_dict(), "options": {**axis.options, "weather_root": missing}}
                             for name, axis in exp.tasks.items()})
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "wind.json").write_text('{"kept": true}')
    calls = spy_on_train(monkeypatch)
    with pytest.raises(ValueError, match="no-such-folder"):
        run_experiment(exp, tmp_path / "results", tmp_path / "runs", jobs=1, quick=True, quiet=True)
    assert calls == [] and (tmp_path / "results" / "wind.json").read_text() == '{"kept": true}'


def test_the_second_metric_is_the_mean_over_seeds_in_the_json_and_a_table_under_the_headline():
    """niah reports the share of the answer's tokens right beside exact match: in the JSON ("second", the same shape
    as "results" and "spread") and in RESULTS.md, as a table under each panel's headline table."""
    from titans.experiments.report import section

    exp = load_experiment("niah", quick=True, folder=FOLDER)
    assert exp.metric == "accuracy" and exp.second_metric == "token_accuracy"
    exp = exp.replace(seeds=[0, 1])
    runs = expand(exp)
    summaries = [{"results": {str(n): {"accuracy": 0.0, "token_accuracy": 0.25 + 0.5 * run.seed, "loss": 1.0}
                              for n in run.config.task.eval_lengths},
                  "num_parameters": 10, "step": 2, "train_seconds": 1.0} for run in runs]
    data = {"experiment": "niah", "metric": exp.metric, "higher_is_better": True,
            **train_results(exp, runs, summaries)}
    setting = runs[0].setting(runs[0].config.task.eval_lengths[-1], exp)
    assert data["results"][runs[0].model][setting] == 0.0  # the headline stays exact match
    assert data["second"]["metric"] == "token_accuracy"
    assert data["second"]["results"][runs[0].model][setting] == 0.5
    assert data["second"]["spread"][runs[0].model][setting] == [0.25, 0.75]
    text = section(data, Path("niah.json"), Path("niah.png"), Path("."))
    headline, second = text.split("Beside it, token_accuracy")
    assert "| 0.00 |" in headline and "0.50 (0.25–0.75)" in second and "0.50" not in headline


def test_a_grid_headlined_by_the_share_shows_exact_match_beside_it_and_never_one_metric_twice():
    """ablations_niah is headlined by the share of the key's digits (exact match was 0 for most rows at its budget when
    it was built) and shows exact match beside it: the pairing reversed, the same table under each panel. A grid
    whose second metric is its headline is refused when it is loaded, naming both."""
    from titans.experiments.report import section

    exp = load_experiment("ablations_niah", quick=True, folder=FOLDER)
    assert exp.metric == "token_accuracy" and exp.second_metric == "accuracy"
    runs = expand(exp)
    summaries = [{"results": {str(n): {"accuracy": 0.25, "token_accuracy": 0.75, "loss": 1.0}
                              for n in run.config.task.eval_lengths},
                  "num_parameters": 10, "step": 2, "train_seconds": 1.0} for run in runs]
    data = {"experiment": exp.name, "metric": exp.metric, "higher_is_better": True,
            **train_results(exp, runs, summaries)}
    setting = runs[0].setting(runs[0].config.task.eval_lengths[-1], exp)
    model = runs[0].model
    assert data["results"][model][setting] == 0.75 and data["second"]["results"][model][setting] == 0.25
    headline, second = section(data, Path("a.json"), Path("a.png"), Path(".")).split("Beside it, accuracy: exact match")
    assert "| 0.75 |" in headline and "| 0.25 |" not in headline
    assert "| 0.25 |" in second and "| 0.75 |" not in second
    with pytest.raises(ValueError, match="second_metric must differ from metric"):
        exp.replace(second_metric="token_accuracy")


def test_every_committed_json_holds_its_grids_words():
    """A grid's title, about and discussion are written in its YAML and copied into its JSON when it runs (the
    report reads the JSON): an edit to the YAML that was never run through `titans experiment run NAME --no-train`
    would leave RESULTS.md saying what the YAML no longer does."""
    for name in experiment_names():
        path = ROOT / "docs" / "results" / f"{name}.json"
        if not path.is_file():
            continue
        data = json.loads(path.read_text())
        for field, words in grid_words(load_experiment(name)).items():
            assert data[field] == words, (name, field)


def test_the_committed_report_is_what_the_committed_jsons_give(tmp_path, monkeypatch):
    """RESULTS.md and the README's headline table are generated (`titans experiment report`): each, as committed, is
    what the committed JSONs give today, so no hand edit and no forgotten report leaves a number the JSONs do not
    hold. (The plots are not drawn here: they are the same JSONs' pictures.)"""
    from titans.experiments import report

    (tmp_path / "docs").mkdir()
    shutil.copytree(ROOT / "docs" / "results", tmp_path / "docs" / "results")
    shutil.copy(ROOT / "docs" / "RESULTS.md", tmp_path / "docs" / "RESULTS.md")
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    monkeypatch.setattr(report, "plot", lambda data, path: None)
    monkeypatch.chdir(tmp_path)
    write_report(Path("docs/results"), Path("docs/RESULTS.md"), Path("README.md"))
    for name in ("docs/RESULTS.md", "README.md"):
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), f"{name}: run `titans experiment report`"
