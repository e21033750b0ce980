"""The measuring grids (`capacity`, `efficiency`) as a ledger, like the training grids: a point measured under
exactly its spec is read back from the results JSON (a fresh clone measures nothing), one measured under another
(a default, the grid or the machine changed since) is shown marked stale until measured again, and the committed
JSONs are current."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from titans.cli import app
from titans.experiments import load_experiment, run_experiment
from titans.experiments.measure import REFERENCE

from .test_experiments import fresh_clone_of

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "configs" / "experiments"
POINT = {"capacity": "capacity_point", "efficiency": "efficiency_point"}
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """The quick tiers of capacity and efficiency, measured once for the module: the results dir."""
    root = tmp_path_factory.mktemp("measured")
    for name in POINT:
        run_experiment(load_experiment(name, quick=True, folder=FOLDER), root / "results", root / "runs", jobs=1,
                       quick=True, quiet=True)
    return root / "results"


def count_points(monkeypatch, name: str) -> list:
    """The points measured from now on (each still measured)."""
    from titans.experiments import measure

    calls, point = [], getattr(measure, POINT[name])

    def spy(*args):
        calls.append(args)
        return point(*args)

    monkeypatch.setattr(measure, POINT[name], spy)
    return calls


def no_train(name: str, clone: Path, runs: Path) -> dict:
    result = CliRunner().invoke(app, ["experiment", "run", name, "--quick", "--no-train", "--results-dir", str(clone),
                                      "--runs-dir", str(runs), "--quiet"])
    assert result.exit_code == 0, result.output
    return json.loads((clone / f"{name}.json").read_text())


@pytest.mark.parametrize("name", list(POINT))
def test_a_fresh_clone_reads_every_point_back_from_the_json(measured, tmp_path, monkeypatch, name):
    before = json.loads((measured / f"{name}.json").read_text())
    assert all("spec" in record for record in before["runs"].values())
    calls = count_points(monkeypatch, name)
    clone = fresh_clone_of(measured, name, tmp_path)
    exp = load_experiment(name, quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert calls == [] and after["results"] == before["results"] and after["runs"] == before["runs"]
    assert "pending" not in after and "stale" not in after
    again = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True,
                                      retrain=True).read_text())  # --retrain measures every point again
    assert len(calls) == len(before["runs"]) and set(again["runs"]) == set(before["runs"])


@pytest.mark.parametrize("name, edit, change", [
    # a record from before records kept their spec, measured under the residual memory (the earlier default)
    ("efficiency", lambda record: (record.pop("spec"), record["config"]["memory"].pop("residual")),
     "model.memory.residual: true → false"),
    # a record of the capacity rule with another step bound (as if the rule's default had changed since)
    ("capacity", lambda record: record["spec"]["rule"].update(max_grad_norm=2.0), "rule.max_grad_norm: 2.0 → 4.0"),
    # a timing taken on another machine is not this one's
    ("efficiency", lambda record: record["spec"].update(machine="another CPU"), "machine: \"another CPU\" → "),
])
def test_a_point_of_an_earlier_spec_is_shown_stale_until_measured_again(measured, tmp_path, monkeypatch, name, edit,
                                                                        change):
    """--no-train measures nothing: the point keeps its values and is pending and listed stale with what changed;
    a run measures it (and it alone) again and clears the mark."""
    before = json.loads((measured / f"{name}.json").read_text())
    changed = next(iter(before["runs"]))

    def edited(data):
        edit(data["runs"][changed])

    clone = fresh_clone_of(measured, name, tmp_path, edited)
    calls = count_points(monkeypatch, name)
    data = no_train(name, clone, tmp_path / "runs")
    assert calls == [] and data["pending"] == [changed] and list(data["stale"]) == [changed]
    assert len(data["stale"][changed]) == 1 and data["stale"][changed][0].startswith(change)
    assert data["runs"][changed]["values"] == before["runs"][changed]["values"] and data["results"] == before["results"]
    exp = load_experiment(name, quick=True, folder=FOLDER)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert len(calls) == 1 and "stale" not in after and "pending" not in after
    assert after["runs"][changed]["spec"] == before["runs"][changed]["spec"]


def test_the_reference_points_are_kept_where_titans_pytorch_is_not_installed(measured, tmp_path, monkeypatch):
    """titans-pytorch's points, recorded with the version they were measured with, are read back as they are on a
    machine without it, never measured nor dropped."""
    before = json.loads((measured / "efficiency.json").read_text())
    ours = next(iter(before["runs"].values()))
    reference = {**ours, "model": REFERENCE, "config": {"dim": 256},
                 "spec": {**ours["spec"], "impl": REFERENCE, "model": {"config": {"dim": 256}, "version": "0.5.5"}}}

    def with_reference(data):
        data["runs"][f"{REFERENCE}-{ours['length']}".replace(" ", "-")] = reference
        data["grid"]["reference"] = True

    exp = load_experiment("efficiency", quick=True, folder=FOLDER)
    exp = exp.replace(efficiency={**exp.efficiency.to_dict(), "reference": True})
    monkeypatch.setattr("titans.experiments.measure.REFERENCE_CONFIG", {"dim": 256})
    monkeypatch.setattr("titans.machine.reference_available", lambda: False)
    calls = count_points(monkeypatch, "efficiency")
    clone = fresh_clone_of(measured, "efficiency", tmp_path, with_reference)
    after = json.loads(run_experiment(exp, clone, tmp_path / "runs", jobs=1, quick=True, quiet=True).read_text())
    assert calls == [] and "stale" not in after and "pending" not in after
    assert after["results"][REFERENCE] == reference["values"]


@pytest.mark.parametrize("name", ["efficiency", "continual"])
def test_measuring_grids_take_no_rows(tmp_path, name):
    rows = CliRunner().invoke(app, ["experiment", "run", name, "--quick", "--only", "lmm", "--results-dir",
                                    str(tmp_path / "untouched")])
    assert rows.exit_code == 2 and "--only is for a training grid" in rows.output
    assert not (tmp_path / "untouched").exists()


@pytest.mark.parametrize("name", [*POINT, "continual"])
def test_the_committed_measurements_are_current(tmp_path, monkeypatch, name):
    """The committed JSON, rewritten with --no-train on the machine it names, has no point stale or pending: every
    point was measured under today's defaults and grid (continual's: under its source's configs of today)."""
    committed = json.loads((ROOT / "docs" / "results" / f"{name}.json").read_text())
    monkeypatch.setattr("titans.machine.describe_machine", lambda: committed["machine"])
    clone = tmp_path / "results"
    clone.mkdir()
    (clone / f"{name}.json").write_text(json.dumps(committed))
    result = CliRunner().invoke(app, ["experiment", "run", name, "--no-train", "--results-dir", str(clone),
                                      "--runs-dir", str(tmp_path / "runs"), "--quiet"])
    assert result.exit_code == 0, result.output
    data = json.loads((clone / f"{name}.json").read_text())
    assert data.get("stale", {}) == {} and data.get("pending", []) == []
    assert data["results"] == committed["results"]
