"""Wind power forecasting: the TMY3 and power-curve readers, the hub-height and power-curve conversions, and the
`forecast_wind` task on the fixture in tests/data/wind (the first 336 hours of pvlib's 703165TY.csv, Sand Point AK,
cut to its date, time and wind columns, and a toy power-curve table); the files pvlib and windpowerlib ship where
they are installed."""

import csv
import importlib.util
from pathlib import Path

import pytest
import torch

from titans.tasks import SeriesBatch, get_task
from titans.tasks.wind import (
    PowerCurve,
    hub_wind_speed,
    power_curve_output,
    read_power_curve,
    read_tmy3_wind,
)

ROOT = Path(__file__).resolve().parents[1] / "data" / "wind"
WEATHER = "703165TY_first336h.csv"
CURVES = ROOT / "power_curves.csv"
HEADER = "1,SITE,XX,0,0,0,0\nDate (MM/DD/YYYY),Time (HH:MM),Wspd (m/s)\n"
INSTALLED = importlib.util.find_spec("pvlib") is not None and importlib.util.find_spec("windpowerlib") is not None


def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def toy(**options):
    """The fixture through the toy turbine, with the hub at 80 m and α = 1/3, so that the hub-height wind is exactly
    twice the measured one ((80 / 10)^(1/3) = 2)."""
    values = dict(weather=WEATHER, weather_root=str(ROOT), curves=str(CURVES), turbine="Toy/1000", hub_height=80.0,
                  shear_exponent=1 / 3)
    return get_task("forecast_wind", **{**values, **options})


def test_read_tmy3_wind_reads_the_station_and_the_hourly_wind_speed():
    record = read_tmy3_wind(ROOT / WEATHER)
    assert record.station == "SAND POINT" and record.wind_speed.dtype == torch.float64
    assert len(record.wind_speed) == 336
    assert record.wind_speed[:6].tolist() == [2.1, 0.0, 3.1, 2.1, 3.6, 3.1]  # the fixture's first six rows
    assert record.wind_speed.max().item() == 12.7


def test_read_power_curve_keeps_the_turbines_tabulated_points():
    toy_curve = read_power_curve(CURVES, "Toy/1000")  # blank cells are speeds the curve does not give
    assert toy_curve.wind_speed.tolist() == [2.0, 4.0, 6.0, 8.0, 12.0]
    assert toy_curve.power.tolist() == [0.0, 200.0, 600.0, 1000.0, 1000.0]
    other = read_power_curve(CURVES, "Other/500")
    assert other.wind_speed.tolist() == [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0] and other.power.max() == 500.0


def test_power_curve_output_interpolates_and_is_zero_outside_the_curve():
    curve = read_power_curve(CURVES, "Toy/1000")
    speeds = torch.tensor([0.0, 1.9, 2.0, 3.0, 4.2, 6.2, 8.0, 10.0, 12.0, 12.01, 30.0], dtype=torch.float64)
    expected = [0.0, 0.0, 0.0, 100.0, 240.0, 640.0, 1000.0, 1000.0, 1000.0, 0.0, 0.0]
    torch.testing.assert_close(power_curve_output(speeds, curve), torch.tensor(expected, dtype=torch.float64),
                               rtol=0, atol=1e-12)
    assert hub_wind_speed(torch.tensor([1.0, 2.5]), 10.0, 80.0, 1 / 3).tolist() == [2.0, 5.0]
    assert hub_wind_speed(torch.tensor([3.0]), 10.0, 80.0, 0.0).tolist() == [3.0]  # α = 0: no shear


def test_conversions_match_windpowerlib():
    """The reference: windpowerlib's own power law and power-curve functions (numpy), in float64, on every turbine
    curve it ships at speeds across and beyond each curve (where windpowerlib and its dependencies are installed)."""
    power_output = pytest.importorskip("windpowerlib.power_output")
    wind_speed = pytest.importorskip("windpowerlib.wind_speed")
    measured = torch.linspace(0, 30, 601, dtype=torch.float64)
    for exponent in (1 / 7, 0.2):
        expected = wind_speed.hellman(measured.numpy(), 10.0, 78.0, hellman_exponent=exponent)
        torch.testing.assert_close(hub_wind_speed(measured, 10.0, 78.0, exponent), torch.from_numpy(expected),
                                   rtol=1e-14, atol=0)
    path = Path(importlib.util.find_spec("windpowerlib").submodule_search_locations[0]) / "data" / \
        "default_turbine_data" / "power_curves.csv"
    turbines = [row[0] for row in csv.reader(path.open()) if row][1:]
    for turbine in turbines:
        curve = read_power_curve(path, turbine)
        expected = power_output.power_curve(measured.numpy(), curve.wind_speed.numpy(), curve.power.numpy())
        torch.testing.assert_close(power_curve_output(measured, curve), torch.from_numpy(expected), rtol=1e-12,
                                   atol=1e-6, msg=turbine)


def test_the_series_is_the_measured_wind_through_the_curve_at_hub_height():
    task = toy(features=["power", "wind_speed"])
    assert task.num_features == 2
    # by hand: 2.1 m/s at 10 m is 4.2 m/s at the hub, 200 + 0.1 (600 - 200) = 240 W of 1000; 0 m/s: nothing; 3.1 m/s
    # is 6.2, 600 + 0.1 (1000 - 600) = 640 W; the wind speed feature: the hub-height speed over the curve's last, 12 m/s
    expected = torch.tensor([[0.24, 4.2 / 12], [0.0, 0.0], [0.64, 6.2 / 12]], dtype=torch.float64)
    torch.testing.assert_close(task.series[:3], expected, rtol=0, atol=1e-12)
    measured = read_tmy3_wind(ROOT / WEATHER).wind_speed
    stormy = measured * 2 > 12  # the hours above the toy curve's cut-out make nothing
    assert stormy.any() and (task.series[stormy, 0] == 0).all()
    assert task.series[:, 0].min() >= 0 and task.series[:, 0].max() == 1.0
    power_only = toy()
    assert power_only.num_features == 1 and torch.equal(power_only.series[:, 0], task.series[:, 0])
    reordered = toy(features=["wind_speed", "power"])
    assert torch.equal(reordered.series, task.series.flip(1))


def test_splits_are_consecutive_hours_70_10_20():
    """336 hours: train the first int(0.7 * 336) = 235, val the next 33 (to int(0.8 * 336) = 268), test the last 68."""
    train, val, test = (toy(split=split) for split in ("train", "val", "test"))
    series = train.series.float()
    assert torch.equal(train.data, series[:235]) and torch.equal(val.data, series[235:268])
    assert torch.equal(test.data, series[268:])
    assert train.held_out().options.split == "val" and train.held_out("test").options.split == "test"


def test_batches_are_next_step_windows_of_the_split():
    task = toy(features=["power", "wind_speed"], split="val")
    a, b, c = (task.sample(5, 20, gen(s)) for s in (1, 1, 2))
    assert isinstance(a, SeriesBatch) and a.inputs.shape == a.targets.shape == (5, 20, 2)
    assert a.inputs.dtype == torch.float32 and torch.equal(a.inputs, b.inputs) and not torch.equal(a.inputs, c.inputs)
    for inputs, targets in zip(a.inputs, a.targets):
        # a window of consecutive hours of the split; the target at t is the hour after input t (nothing later)
        starts = [s for s in range(len(task.data) - 20) if torch.equal(task.data[s:s + 20], inputs)]
        assert starts and torch.equal(targets, task.data[starts[0] + 1:starts[0] + 21])
    with pytest.raises(ValueError, match="length 33 is too long for the val split of 703165TY_first336h.csv"):
        task.sample(1, 33, gen())
    assert task.sample(1, 32, gen()).inputs.shape == (1, 32, 2)


def test_files_are_read_on_first_use_and_missing_packages_are_named(monkeypatch):
    task = toy(weather="none.csv")  # builds: nothing read yet
    assert task.num_features == 1
    with pytest.raises(ValueError, match="TMY3 file .*none.csv does not exist"):
        task.sample(1, 4, gen())
    with pytest.raises(ValueError, match="no turbine 'Nope'; its turbines: Other/500, Toy/1000"):
        toy(turbine="Nope").data
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pvlib is not installed: .*pip install pvlib windpowerlib.*titans\[wind\]"):
        get_task("forecast_wind").data
    with pytest.raises(ValueError, match="windpowerlib is not installed"):
        get_task("forecast_wind", weather=WEATHER, weather_root=str(ROOT)).data
    assert toy().data.shape == (235, 1)  # given both files, neither package is looked for


@pytest.mark.parametrize("options, message", [
    ({"features": ["power", "power"]}, "features must be distinct"),
    ({"features": []}, "features"),
    ({"features": ["speed"]}, "features"),
    ({"weather": "data/703165TY.csv"}, "weather must name one file"),
    ({"curves": ""}, "curves must name a path"),
    ({"hub_height": 0.0}, "hub_height"),
    ({"shear_exponent": 1.5}, "shear_exponent"),
])
def test_options_are_checked(options, message):
    with pytest.raises(ValueError, match=message):
        get_task("forecast_wind", **options)


@pytest.mark.parametrize("body, message", [
    ("", "a station line, a header line and data rows"),
    ("01/01/1997,01:00,2.0\n01/01/1997,03:00,2.0\n", "line 4: 01/01/1997 03:00, where the next hour is 01/01 02:00"),
    ("".join(f"01/01/1997,{h:02d}:00,1\n" for h in range(1, 25)) + "01/03/1997,01:00,1\n",
     "line 27: .*where the next hour is 01/02 01:00"),
    ("01/01/1997,01:00,-9900\n", "line 3: wind speed '-9900' is not a measured speed"),
    ("01/01/1997,01:00,nan\n", "line 3: wind speed 'nan' is not a measured speed"),
    ("01/01/1997,01:00,calm\n", "line 3: wind speed 'calm' is not a number"),
    ("1997-01-01,01:00,2\n", "line 3: date '1997-01-01' is not MM/DD/YYYY"),
    ("01/01/1997,01:00\n", "line 3: 2 fields"),
])
def test_tmy3_files_that_are_not_consecutive_measured_hours_are_refused(tmp_path, body, message):
    path = tmp_path / "site.csv"
    path.write_text(HEADER + body if body else HEADER.splitlines()[0] + "\n")
    with pytest.raises(ValueError, match=message):
        read_tmy3_wind(path)


def test_tmy3_files_without_the_wind_speed_column_are_refused(tmp_path):
    path = tmp_path / "site.csv"
    path.write_text(HEADER.replace("Wspd (m/s)", "Wdir (degrees)") + "01/01/1997,01:00,2.0\n")
    with pytest.raises(ValueError, match=r"no column\(s\) \['Wspd \(m/s\)'\]"):
        read_tmy3_wind(path)


@pytest.mark.parametrize("text, message", [
    ("speed,1,2\nT,0,1\n", "first line must be 'turbine_type,'"),
    ("turbine_type,1,x\nT,0,1\n", "wind speeds must be numbers"),
    ("turbine_type,1,2\nT,0,1,2\n", "3 values for the header's 2 wind speeds"),
    ("turbine_type,1,2\nT,0,lots\n", "values must be numbers"),
    ("turbine_type,1,2\nT,0,\n", "two or more wind speeds, it has 1"),
    ("turbine_type,2,1\nT,0,1\n", "wind speeds must increase"),
    ("turbine_type,1,2\nT,0,-1\n", "finite, >= 0 and somewhere > 0"),
    ("turbine_type,1,2\nT,0,0\n", "finite, >= 0 and somewhere > 0"),
])
def test_power_curve_tables_that_are_not_curves_are_refused(tmp_path, text, message):
    path = tmp_path / "curves.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        read_power_curve(path, "T")


@pytest.mark.skipif(not INSTALLED, reason="pvlib and windpowerlib (the wind extra) are not installed")
def test_the_files_pvlib_and_windpowerlib_ship():
    task = get_task("forecast_wind")
    assert task.series.shape == (8760, 1) and 0 <= task.series.min() and task.series.max() == 1.0
    assert [len(get_task("forecast_wind", split=s).data) for s in ("train", "val", "test")] == [6132, 876, 1752]
    assert read_tmy3_wind(Path(importlib.util.find_spec("pvlib").submodule_search_locations[0]) / "data" /
                          "723170TYA.CSV").station == "GREENSBORO PIEDMONT TRIAD INT"
    # the rated power the series is divided by, the curve's highest output, is the E-82/2350's nominal power
    folder = Path(importlib.util.find_spec("windpowerlib").submodule_search_locations[0]) / "data" / \
        "default_turbine_data"
    nominal = next(float(row["nominal_power"]) for row in csv.DictReader((folder / "turbine_data.csv").open())
                   if row["turbine_type"] == "E-82/2350")
    curve = read_power_curve(folder / "power_curves.csv", "E-82/2350")
    assert isinstance(curve, PowerCurve) and curve.power.max().item() == nominal == 2_350_000
    assert curve.wind_speed[-1].item() == 25.0  # its cut-out, the wind speed feature's unit
