"""What training and evaluation share: the rows of a batch, each drawn from its own seed, and what a batch costs (the
sum of the per-position losses over its scored positions), read whole or a piece at a time through the state.

Row i of a batch is drawn from the seed (*stream, i) (`sample_rows`, `derive_seed`): the training stream is keyed by
(seed, step), the evaluation stream by (seed, length), so the two never meet and every model is scored on the same
sequences.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..io.state import detached
from ..tasks import IGNORE_INDEX, LabelBatch, Task, TokenBatch
from ..tasks.base import Batch
from .precision import autocast

TRAIN_STREAM, EVAL_STREAM = 1, 2  # keep the training and evaluation data streams disjoint
DROPOUT_STREAM = 3  # the global RNG (dropout) is reseeded per (seed, step, rank)
_MASK64 = (1 << 64) - 1


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers: SplitMix64's finaliser chained over the parts (stable across
    processes and Python versions, unlike `hash`)."""
    state = 0
    for part in parts:
        state = (state ^ (part & _MASK64)) + 0x9E3779B97F4A7C15 & _MASK64
        state = (state ^ (state >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
        state = (state ^ (state >> 27)) * 0x94D049BB133111EB & _MASK64
        state ^= state >> 31
    return state >> 1


def sample_rows(task: Task, rows: range, length: int, *stream: int) -> Batch:
    """Rows `rows` of a batch whose row i is drawn from the seed (*stream, i) (`Task.sample_seeded`)."""
    return task.sample_seeded([derive_seed(*stream, i) for i in rows], length)


def scored_positions(batch: Batch) -> int:
    """Token positions scored, series values predicted, or (classification) series classified."""
    if isinstance(batch, TokenBatch):
        return int((batch.targets != IGNORE_INDEX).sum())
    return batch.targets.numel()


def _pieces(model: nn.Module, inputs: Tensor, piece: int) -> list[Tensor]:
    """The model's outputs for each `piece` positions of `inputs` in turn, the recurrent state carried between calls."""
    outputs, state = [], None
    for start in range(0, inputs.shape[1], piece):
        out, state = model(inputs[:, start:start + piece], state)
        outputs.append(out)
    return outputs


def streamed(model: nn.Module, inputs: Tensor, piece: int | None) -> Tensor:
    """The model's outputs for `inputs`, read `piece` positions per call through the recurrent state (the whole
    sequence in one call when None): the same outputs either way, up to rounding, in memory that stops growing
    with the length for every variant but full attention."""
    return model(inputs)[0] if piece is None else torch.cat(_pieces(model, inputs, piece), 1)


def streamed_last(model: nn.Module, inputs: Tensor, piece: int | None) -> Tensor:
    """The outputs of a model that reads a whole sequence into one output (a classifier of the last hidden state),
    `piece` positions per call through the recurrent state: the last call's outputs."""
    return model(inputs)[0] if piece is None else _pieces(model, inputs, piece)[-1]


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory, without waiting: a copy from pageable memory would
    first wait for every kernel queued before it (a host sync per batch)."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def loss_terms(model: nn.Module, batch: Batch, device: torch.device,
               piece: int | None = None, precision: str = "float32") -> tuple[Tensor, Tensor]:
    """(sum of the per-position losses over the scored positions, model outputs); cross-entropy for
    token tasks and for classification (one loss per series), squared error for series. `piece`: read the sequence
    that many positions at a time (`streamed`). `precision`: the run's `dtype`; the forward pass runs in its autocast
    (`precision.autocast`), the loss in the parameters' dtype (float32 master weights under bf16)."""
    dtype = next(model.parameters()).dtype
    inputs = to_device(batch.inputs, device)
    if isinstance(batch, LabelBatch):
        with autocast(precision, device):
            logits = streamed_last(model, inputs.to(dtype), piece)
        return F.cross_entropy(logits.to(dtype), to_device(batch.targets, device), reduction="sum"), logits
    with autocast(precision, device):
        outputs = streamed(model, inputs if isinstance(batch, TokenBatch) else inputs.to(dtype), piece)
    return position_loss(outputs, batch, device, dtype), outputs


def carried_loss_terms(model: nn.Module, batch: Batch, device: torch.device, state: Any,
                       precision: str = "float32") -> tuple[Tensor, Any]:
    """(`loss_terms`' sum of losses, the state the model ended in, detached) for a window read on from `state`:
    one step of truncated backpropagation through time (`TrainConfig.carry_windows`)."""
    dtype = next(model.parameters()).dtype
    inputs = to_device(batch.inputs, device)
    with autocast(precision, device):
        outputs, end = model(inputs if isinstance(batch, TokenBatch) else inputs.to(dtype), state)
    return position_loss(outputs, batch, device, dtype), detached(end)


def position_loss(outputs: Tensor, batch: Batch, device: torch.device, dtype: torch.dtype) -> Tensor:
    """The sum of the per-position losses of `outputs` over the batch's scored positions, in `dtype` (the
    parameters': float32 master weights under bf16): cross-entropy for tokens, squared error for series."""
    targets = to_device(batch.targets, device)
    if isinstance(batch, TokenBatch):
        return F.cross_entropy(outputs.flatten(0, 1).to(dtype), targets.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum")
    return F.mse_loss(outputs.to(dtype), targets.to(dtype), reduction="sum")
