"""Experiments: grids of runs from configs/experiments/*.yaml, their results JSON, and the report built from them."""

from .report import write_report
from .runner import run_experiment
from .runs import train_one
from .spec import Experiment, Run, expand, experiment_names, load_experiment

__all__ = ["Experiment", "Run", "expand", "experiment_names", "load_experiment", "run_experiment", "train_one",
           "write_report"]
