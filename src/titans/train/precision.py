"""What `train.dtype` means for the weights and for the arithmetic of a forward pass.

"float32" and "float64": the parameters, activations and memory state in that dtype, no autocast.
"bfloat16": mixed precision as GPU training does it: the parameters (the optimiser's master weights) stay float32 and
the forward pass runs under `torch.autocast(device, bfloat16)`, so matmuls and attention take bf16 inputs while
reductions, norms and the loss stay float32. The memory's state is not autocast: `parallel_memory` and its peers run
with autocast off (`memory.checks.without_autocast`) and keep W and S in the dtype of the memory's initial weights,
float32 here (DESIGN.md §1: the bounded state is a float32 invariant). No loss scaling: bf16 has float32's exponent
range, so gradients do not underflow the way float16's do.
"""

from __future__ import annotations

import contextlib
from typing import ContextManager, Literal

import torch

Precision = Literal["float32", "float64", "bfloat16"]
PRECISIONS: tuple[str, ...] = ("float32", "float64", "bfloat16")
AUTOCAST_DTYPES = {"bfloat16": torch.bfloat16}  # precision -> the dtype autocast computes in


def _checked(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def parameter_dtype(precision: str) -> torch.dtype:
    """The dtype of the parameters (and optimiser state) a run of this precision keeps: float32 master weights under
    bf16 autocast."""
    return torch.float32 if _checked(precision) in AUTOCAST_DTYPES else getattr(torch, precision)


def autocast(precision: str, device: torch.device | str) -> ContextManager:
    """The context a forward pass of this precision runs in on `device`: bf16 autocast, or nothing."""
    dtype = AUTOCAST_DTYPES.get(_checked(precision))
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)
