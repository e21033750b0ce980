"""Tasks: generated (seeded) or read from local files; nothing is downloaded."""

from . import babilong, copying, forecast, lm, needle, recall  # noqa: F401  (register the tasks)
from .base import IGNORE_INDEX, TASKS, SeriesBatch, Task, TokenBatch, exact_match, get_task, token_accuracy
from .lm import bits_per_byte
from .recall import measure_capacity

__all__ = ["IGNORE_INDEX", "TASKS", "SeriesBatch", "Task", "TokenBatch", "exact_match", "get_task",
           "token_accuracy", "bits_per_byte", "measure_capacity"]
