"""Tasks: generated (seeded) or read from local files; nothing is downloaded.

`get_task(name, **options)` builds any task in `TASKS`; `task.sample(batch_size, length, generator)`
returns a `TokenBatch`, `SeriesBatch` or `LabelBatch` of exactly `length` positions.
"""

from . import babilong, copying, forecast, lm, lm_tokens, needle, recall, ucr, wind  # noqa: F401  (importing registers the tasks)
from .base import (
    IGNORE_INDEX,
    TASKS,
    LabelBatch,
    SeriesBatch,
    Task,
    TaskOptions,
    TokenBatch,
    exact_match,
    get_task,
    token_accuracy,
    tokens_right,
)
from .lm import bits_per_byte
from .recall import CapacityResult, measure_capacity

__all__ = ["IGNORE_INDEX", "TASKS", "CapacityResult", "LabelBatch", "SeriesBatch", "Task", "TaskOptions", "TokenBatch",
           "bits_per_byte", "exact_match", "get_task", "measure_capacity", "token_accuracy", "tokens_right"]
