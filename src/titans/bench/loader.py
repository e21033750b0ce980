"""How fast the trainer's batches come out of token shards: `titans bench loader DIR`.

It times exactly what a training step does before the model runs: `batches.sample_rows` draws the rank's rows from their
seeds (`lm_tokens`: a window of each memory-mapped shard per row) and, where there is a GPU, each tensor is copied into
pinned memory, as `batches.to_device` does before its non-blocking copy. Without an accelerator torch has no pinned
allocator, so the batches stay in pageable memory and the JSON says so (`pinned`: false).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..tasks import get_task
from ..train.batches import TRAIN_STREAM, sample_rows


@dataclass(frozen=True)
class LoaderPoint:
    length: int
    batch_size: int
    batches: int
    seconds: float
    tokens_per_s: float
    pinned: bool


def measure_loader(data: str, split: str, length: int, batch_size: int, seconds: float) -> LoaderPoint:
    """Draw batches of `batch_size` rows of `length` tokens from the shards in `data` for about `seconds`."""
    task = get_task("lm_tokens", data=data, split=split)
    pin = torch.cuda.is_available()
    sample_rows(task, range(batch_size), length, TRAIN_STREAM, 0, 0)  # the shards opened, their pages touched once
    batches, start = 0, time.perf_counter()
    while True:
        batch = sample_rows(task, range(batch_size), length, TRAIN_STREAM, 0, batches + 1)
        if pin:
            batch = type(batch)(*(t.pin_memory() for t in batch))
        batches += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            break
    return LoaderPoint(length, batch_size, batches, elapsed, batches * batch_size * length / elapsed, pin)


def as_record(point: LoaderPoint) -> dict:
    return asdict(point)
