"""Wind power forecasting: a year of measured hourly wind at one site, turned into a turbine's output.

The data come from installed packages, never from the network, and neither package is imported (we read only files
they ship, so their own dependencies need not be installed):
- pvlib ships two TMY3 files (typical meteorological years of the US National Solar Radiation Database, 8760 hourly
  rows of measured weather, each calendar month taken whole from one measured year): `703165TY.csv`, Sand Point,
  Alaska (an island airport in the Shumagin Islands off the Alaska Peninsula, mean wind 5.1 m/s at 10 m) and
  `723170TYA.CSV`, Greensboro, North Carolina (an inland airport, mean 3.1 m/s). A TMY3 file's first line describes
  the station (USAF id, name, state, time zone, latitude, longitude, elevation), its second names the columns; we
  read `Date (MM/DD/YYYY)`, `Time (HH:MM)` (hour ending, 01:00 to 24:00) and `Wspd (m/s)`.
- windpowerlib ships published power curves (`data/default_turbine_data/power_curves.csv`): one row per turbine
  type, the electrical output in W at the wind speeds of the header row, blank where the manufacturer gives none.

The series: the wind speed measured at `measurement_height` is carried to the turbine's hub height by the power law
(`hub_wind_speed`), then through the power curve (`power_curve_output`), and divided by the rated power, so that
it lies in [0, 1]. Batches are `SeriesBatch`es of next-step forecasting, as `forecast_csv`: windows of consecutive
hours of one split, the year split 70/10/20 by time (train 1 January to 12 September, val to 19 October, test the
rest): a forecaster is scored on hours after every hour it trained on, and hourly wind is so strongly correlated
from one hour to the next that windows drawn at random from the whole year would put near copies of the evaluation
hours into training. Training on one site and testing on the other was the alternative; we did not take it because
the two sites' series differ in kind, not only in place: at the default hub height the E-82/2350 makes 32% of its
rated power on average at Sand Point and 9% at Greensboro (hub-height wind 6.8 against 4.1 m/s), so a model
trained on one would be scored on another distribution of outputs rather than on later hours of the same one.
"""

from __future__ import annotations

import csv
import datetime
import math
from functools import cached_property
from pathlib import Path
from typing import Literal, NamedTuple, Optional

import torch
from pydantic import Field, model_validator

from .base import SeriesBatch, Task, TaskOptions, package_folder, register
from .forecast import next_step_windows, split_bounds

INSTALL_HINT = ("the wind task reads the TMY3 weather files pvlib ships and the power curves windpowerlib ships: pip "
                "install pvlib windpowerlib (the titans extra `wind`: pip install 'titans[wind]'), or set the task's "
                "`weather_root` (a folder holding the TMY3 file) and `curves` (a power_curves.csv)")
WIND_SPEED = "Wspd (m/s)"
DATE, TIME = "Date (MM/DD/YYYY)", "Time (HH:MM)"
FEATURES = ("power", "wind_speed")


class WindRecord(NamedTuple):
    """The wind speed column of one TMY3 file: the station's name and [hours] float64 speeds in m/s."""

    station: str
    wind_speed: torch.Tensor


class PowerCurve(NamedTuple):
    """A turbine's published power curve: wind speeds [points] in m/s, increasing, and its output there [points] in
    W, both float64."""

    turbine: str
    wind_speed: torch.Tensor
    power: torch.Tensor


def _read_rows(path: Path, what: str) -> list[list[str]]:
    if not path.is_file():
        raise ValueError(f"{what} {path} {'is a directory, not a file' if path.is_dir() else 'does not exist'}")
    try:
        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.reader(f))
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {path} is not UTF-8 text ({err.reason})") from None
    except csv.Error as err:
        raise ValueError(f"{what} {path} cannot be read as CSV: {err}") from None


def read_tmy3_wind(path: str | Path) -> WindRecord:
    """The measured wind speed of a TMY3 file, checked to be consecutive hours (01:00 to 24:00 of consecutive
    calendar days, as TMY3 files are laid out) with every value a number >= 0 (TMY3 marks a missing value -9900)."""
    path = Path(path)
    rows = _read_rows(path, "TMY3 file")
    if len(rows) < 3:
        raise ValueError(f"TMY3 file {path} needs a station line, a header line and data rows; it has {len(rows)} "
                         "line(s)")
    station, header, body = rows[0], rows[1], rows[2:]
    missing = [name for name in (DATE, TIME, WIND_SPEED) if name not in header]
    if missing:
        raise ValueError(f"TMY3 file {path} has no column(s) {missing} in its second line (the header)")
    date_col, time_col, speed_col = (header.index(name) for name in (DATE, TIME, WIND_SPEED))
    speeds = []
    first_day = None
    for number, row in enumerate(body, 3):
        hour = number - 3
        where = f"TMY3 file {path}, line {number}"
        if len(row) <= max(date_col, time_col, speed_col):
            raise ValueError(f"{where}: {len(row)} fields, fewer than the header's columns")
        try:
            month, day, _ = (int(part) for part in row[date_col].split("/"))
            # the months come from different measured years, so only month and day must follow on (a year with
            # no 29 February: TMY3 files have none)
            day_of_year = datetime.date(2001, month, day)
        except ValueError:
            raise ValueError(f"{where}: date {row[date_col]!r} is not MM/DD/YYYY") from None
        first_day = first_day or day_of_year
        expected_day = first_day + datetime.timedelta(days=hour // 24)
        expected_time = f"{hour % 24 + 1:02d}:00"
        if (day_of_year.month, day_of_year.day) != (expected_day.month, expected_day.day) or \
                row[time_col].strip() != expected_time:
            raise ValueError(f"{where}: {row[date_col]} {row[time_col]}, where the next hour is "
                             f"{expected_day.month:02d}/{expected_day.day:02d} {expected_time}: the rows must be "
                             "consecutive hours")
        try:
            speed = float(row[speed_col])
        except ValueError:
            raise ValueError(f"{where}: wind speed {row[speed_col]!r} is not a number") from None
        if not (math.isfinite(speed) and speed >= 0):
            raise ValueError(f"{where}: wind speed {row[speed_col]!r} is not a measured speed (a number >= 0; TMY3 "
                             "marks a missing value -9900)")
        speeds.append(speed)
    name = station[1].strip() if len(station) > 1 else path.stem
    return WindRecord(name, torch.tensor(speeds, dtype=torch.float64))


def read_power_curve(path: str | Path, turbine: str) -> PowerCurve:
    """`turbine`'s row of a power-curve table laid out as windpowerlib's power_curves.csv: a header `turbine_type`
    and wind speeds in m/s, then one row per turbine type, its output in W at those speeds, blank where it has none."""
    path = Path(path)
    rows = _read_rows(path, "power curve file")
    if not rows or not rows[0] or rows[0][0] != "turbine_type":
        raise ValueError(f"power curve file {path}: its first line must be 'turbine_type,' and the wind speeds")
    try:
        grid = [float(cell) for cell in rows[0][1:]]
    except ValueError:
        raise ValueError(f"power curve file {path}: the header's wind speeds must be numbers") from None
    row = next((r for r in rows[1:] if r and r[0] == turbine), None)
    if row is None:
        known = sorted(r[0] for r in rows[1:] if r)
        raise ValueError(f"power curve file {path} has no turbine {turbine!r}; its turbines: {', '.join(known)}")
    where = f"power curve file {path}, turbine {turbine}"
    if len(row) > len(grid) + 1:
        raise ValueError(f"{where}: {len(row) - 1} values for the header's {len(grid)} wind speeds")
    try:
        points = [(grid[i], float(cell)) for i, cell in enumerate(row[1:]) if cell.strip()]
    except ValueError:
        raise ValueError(f"{where}: its values must be numbers (or blank)") from None
    if len(points) < 2:
        raise ValueError(f"{where}: a curve needs values at two or more wind speeds, it has {len(points)}")
    speeds, power = (torch.tensor(column, dtype=torch.float64) for column in zip(*points))
    if not (torch.isfinite(speeds).all() and (speeds.diff() > 0).all()):
        raise ValueError(f"{where}: the header's wind speeds must increase")
    if not (torch.isfinite(power).all() and (power >= 0).all() and power.max() > 0):
        raise ValueError(f"{where}: the output must be finite, >= 0 and somewhere > 0")
    return PowerCurve(turbine, speeds, power)


def hub_wind_speed(wind_speed: torch.Tensor, measurement_height: float, hub_height: float,
                   shear_exponent: float) -> torch.Tensor:
    """The wind speed at `hub_height` from the one measured at `measurement_height` by the power law (Hellman):
    v_hub = v (h_hub / h_measured)^α.

    We use the power law, not the logarithmic profile v ln(h_hub / z0) / ln(h_measured / z0), because the log profile
    needs the surface's roughness length z0, which a TMY3 file does not give and which differs between its sites
    (open water by Sand Point, grass by Greensboro's runways); α = 1/7 is the standard exponent for neutral
    stability over open terrain (Peterson and Hennessey 1978), and windpowerlib's default where no roughness is
    known."""
    return wind_speed * (hub_height / measurement_height) ** shear_exponent


def power_curve_output(wind_speed: torch.Tensor, curve: PowerCurve) -> torch.Tensor:
    """The turbine's output in W at each wind speed: the curve interpolated linearly between its points, zero below
    its first speed (before cut-in) and above its last (after cut-out), as windpowerlib's `power_curve` does."""
    speeds, power = curve.wind_speed, curve.power
    upper = torch.searchsorted(speeds, wind_speed, right=True).clamp(1, len(speeds) - 1)
    lower = upper - 1
    fraction = (wind_speed - speeds[lower]) / (speeds[upper] - speeds[lower])
    inside = (wind_speed >= speeds[0]) & (wind_speed <= speeds[-1])
    return torch.where(inside, power[lower] + fraction * (power[upper] - power[lower]), 0.0)


class WindOptions(TaskOptions):
    weather: str = "703165TY.csv"  # a TMY3 file name in weather_root (pvlib ships 703165TY.csv and 723170TYA.CSV)
    weather_root: Optional[str] = None  # folder holding it; None: pvlib's bundled data folder
    # a turbine type (row) of the power curve table. The default, Enercon's E-82 at 2.35 MW, is a widely built onshore
    # turbine whose tabulated curve tops out at its nominal power (so dividing by the curve's maximum divides by the
    # rated power) and runs to a 25 m/s cut-out; full output from 14 m/s
    turbine: str = "E-82/2350"
    curves: Optional[str] = None  # a power_curves.csv; None: the one windpowerlib ships
    # the anemometer's height: 10 m, that of the airport stations (ASOS) TMY3 files are measured at
    measurement_height: float = Field(10.0, gt=0)
    hub_height: float = Field(78.0, gt=0)  # the E-82/2350's tabulated hub heights are 59, 69, 78 and 84 m
    shear_exponent: float = Field(1 / 7, ge=0, le=1)  # α of the power law (`hub_wind_speed`)
    # the series' features, in this order: the output as a fraction of rated power, and the hub-height wind speed as
    # a fraction of the curve's last speed (its cut-out: 25 m/s for the E-82/2350), both on a scale of about 1
    features: list[Literal["power", "wind_speed"]] = Field(default_factory=lambda: ["power"], min_length=1)
    split: Literal["train", "val", "test"] = "train"

    @model_validator(mode="after")
    def check_rules(self) -> WindOptions:
        if not self.weather or Path(self.weather).name != self.weather:
            raise ValueError(f"weather must name one file (no path; its folder is weather_root), got {self.weather!r}")
        if len(set(self.features)) != len(self.features):
            raise ValueError(f"features must be distinct, got {self.features}")
        for field in ("weather_root", "curves"):
            if getattr(self, field) == "":
                raise ValueError(f"{field} must name a path (or be left out for the package's bundled files)")
        return self


@register
class ForecastWind(Task):
    """Next-step forecasting of a wind turbine's hourly output (and optionally the hub-height wind speed) at a TMY3
    site. The files are read on first use, not when the task is built, so a config naming them loads and expands
    where the packages are not installed; training it then fails before anything is written, naming what to
    install."""

    name = "forecast_wind"
    Options = WindOptions

    @property
    def num_features(self) -> int:  # type: ignore[override]
        return len(self.options.features)

    @cached_property
    def series(self) -> torch.Tensor:
        """[hours, features] float64: the whole year, every feature, before splitting."""
        o = self.options
        weather_root = Path(o.weather_root) if o.weather_root else package_folder("pvlib", INSTALL_HINT) / "data"
        curves = Path(o.curves) if o.curves else \
            package_folder("windpowerlib", INSTALL_HINT) / "data" / "default_turbine_data" / "power_curves.csv"
        record = read_tmy3_wind(weather_root / o.weather)
        curve = read_power_curve(curves, o.turbine)
        hub = hub_wind_speed(record.wind_speed, o.measurement_height, o.hub_height, o.shear_exponent)
        # rated power: the curve's highest output (for the E-82/2350 its nominal 2,350 kW; tests check it)
        columns = {"power": power_curve_output(hub, curve) / curve.power.max(),
                   "wind_speed": hub / curve.wind_speed[-1]}
        return torch.stack([columns[name] for name in o.features], dim=1)

    @cached_property
    def data(self) -> torch.Tensor:
        """[hours, features] float32: the rows of this task's split."""
        bounds = split_bounds(len(self.series))
        if any(hi <= lo for lo, hi in bounds.values()):
            raise ValueError(f"TMY3 file {self.options.weather} is too short ({len(self.series)} hours) to split "
                             "70/10/20 into train/val/test")
        return self.series[slice(*bounds[self.options.split])].float()

    def _generate(self, batch_size: int, length: int, generator: torch.Generator) -> SeriesBatch:
        return next_step_windows(self.data, batch_size, length, generator,
                                 f"the {self.options.split} split of {self.options.weather}")
